"""Triton's system shared-memory extension: tensors that live in a client's POSIX shared memory.

A client on the same host creates a shared-memory object (`shm_open`: /dev/shm/KEY), registers
part of it under a name, and then names that region (with an offset and a byte size) in place
of an input's data, or as where an output goes. The tensor then never travels in the request or
the answer: the server opens the object once, copies inputs out of it and writes outputs into it.
`tritonclient.utils.shared_memory` makes and fills such objects.

The object is read and written through its file (pread, pwrite), never mapped: a client may
shrink its object at any time, and touching a mapping past the object's new end faults (SIGBUS),
which ends the whole server; a read there comes back short and is refused, a write there grows
the object. An input is copied when its request is decoded, so a queued request holds its own
bytes: the copies count against a bound of their own (--max-in-flight-bytes), and are let go of
when the request's arrays are.

Every reference is checked against its region's bounds, and every region against its object's
size, before any work. A region that is unregistered while a request uses it stays open until
that request lets go of it, so unregistering never fails a running batch; new requests no longer
find it.
"""

from __future__ import annotations

import itertools
import os
import re
import resource
import stat
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.errors import InvalidInput, ServerBusy, Unsupported
from server.protocol.binary import tensor_to_bytes
from server.protocol.datatypes import BYTES, numpy_dtype
from server.protocol.shared_memory import RegionRef

SHM_FOLDER = "/dev/shm"  # where Linux keeps POSIX shared-memory objects
MAX_REGIONS = 1024  # each region holds an open file: at most a quarter of the process's limit (regions_allowed)
_KEY = re.compile(r"/?[^/\x00]{1,255}")
NOT_ALLOWED = ("this server does not take client shared memory; start it with --allow-client-shm "
               "(BATCHLINE_ALLOW_CLIENT_SHM=1) to let same-host clients register regions")


def regions_allowed() -> int:
    """MAX_REGIONS, or a quarter of the open files this process may hold if that is fewer: the
    rest are for connections, models and logs."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_REGIONS if soft == resource.RLIM_INFINITY else max(1, min(MAX_REGIONS, soft // 4))


class SharedObject:
    """A client's shared-memory object, open for reading and writing; closed when the last
    region or request that holds it lets go."""

    __slots__ = ("fd", "key")

    def __init__(self, key: str, fd: int) -> None:
        self.key = key
        self.fd = fd

    def __del__(self) -> None:
        os.close(self.fd)

    def read_into(self, buffer: np.ndarray, start: int) -> None:
        """Fill `buffer` from `start` on; InvalidInput if the object no longer reaches that far."""
        view = buffer.data.cast("B")
        done = 0
        while done < view.nbytes:
            try:
                count = os.preadv(self.fd, [view[done:]], start + done)
            except OSError as exc:
                raise self.failed("read", exc) from None
            if count == 0:
                raise self.shrunk(start + view.nbytes)
            done += count

    def write(self, data: np.ndarray, start: int) -> None:
        view = data.data.cast("B")
        done = 0
        while done < view.nbytes:
            try:
                done += os.pwrite(self.fd, view[done:], start + done)
            except OSError as exc:  # e.g. /dev/shm full under an object with holes
                raise self.failed("write", exc) from None

    def check_reaches(self, end: int) -> None:
        """InvalidInput if the object is now shorter than `end` bytes: a write would grow it."""
        if os.fstat(self.fd).st_size < end:
            raise self.shrunk(end)

    def failed(self, doing: str, exc: OSError) -> InvalidInput:
        return InvalidInput(f"cannot {doing} shared-memory object '{self.key}': {exc.strerror}")

    def shrunk(self, end: int) -> InvalidInput:
        return InvalidInput(f"shared-memory object '{self.key}' no longer holds {end} bytes: it was made smaller "
                            "after it was registered; register it again")


@dataclass(frozen=True, slots=True)
class Region:
    """A registered region: `byte_size` bytes at `offset` into the object `key`, open."""

    name: str
    key: str
    offset: int
    byte_size: int
    shared: SharedObject  # the object's open file; it stays open while a request holds the region

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def window(self, ref: RegionRef, what: str) -> Window:
        """Where in the object the bytes `ref` names lie, after checking they lie inside this region."""
        if ref.offset + ref.byte_size > self.byte_size:
            raise InvalidInput(
                f"{what}: {ref.byte_size} bytes at offset {ref.offset} run past the end of shared-memory region "
                f"'{self.name}' ({self.byte_size} bytes)")
        return Window(self, self.offset + ref.offset, ref.byte_size)


@dataclass(frozen=True, slots=True)
class Window:
    """`byte_size` bytes at `start` into a region's object: where one tensor lies, bounds-checked."""

    region: Region
    start: int
    byte_size: int


class SystemSharedMemory:
    """The regions clients registered, by name, and the bytes copied out of them. Thread-safe:
    front ends and worker threads (which decode big requests) look regions up while control calls
    change the table."""

    def __init__(self, allowed: bool = False, max_input_bytes: int = 64 << 20, max_copied_bytes: int = 1 << 30,
                 folder: str = SHM_FOLDER) -> None:
        """`max_input_bytes`: the most one input may take from a region (the server's body limit).
        `max_copied_bytes`: the most the inputs of requests in flight may hold in all (the bound
        on bytes in flight); a request alone is always let in."""
        self.allowed = allowed
        self.max_input_bytes = max_input_bytes
        self.max_copied_bytes = max_copied_bytes
        self.copied_bytes = 0  # held now by inputs copied out of regions
        self.max_regions = regions_allowed()
        self._folder = folder
        self._regions: dict[str, Region] = {}
        # Reentrant: a copy freed by a garbage collection gives its bytes back (_copy_freed) in
        # whichever thread collects, which may be one that holds the lock already.
        self._lock = threading.RLock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._require_allowed()
        if not name:
            raise InvalidInput("a shared-memory region needs a name")
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key.lstrip("/") in (".", ".."):
            raise InvalidInput(f"'{str(key)[:80]}' is not a shared-memory key: give the name it was created with "
                               "(shm_open), such as /my_region")
        if type(offset) is not int or offset < 0 or type(byte_size) is not int or byte_size <= 0:
            raise InvalidInput("a shared-memory region needs a non-negative 'offset' and a positive 'byte_size'")
        with self._lock:
            self._check_room(name)
        shared = self._open(key, offset, byte_size)
        with self._lock:  # again: a concurrent call may have registered meanwhile
            self._check_room(name)
            self._regions[name] = Region(name, key, offset, byte_size, shared)

    def _check_room(self, name: str) -> None:
        """Under the lock: the name is free and a region more fits."""
        if name in self._regions:
            raise InvalidInput(f"shared-memory region '{name}' is already registered; unregister it first")
        if len(self._regions) >= self.max_regions:
            raise InvalidInput(f"{self.max_regions} shared-memory regions are registered already; unregister some")

    def _open(self, key: str, offset: int, byte_size: int) -> SharedObject:
        path = os.path.join(self._folder, key.lstrip("/"))
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise InvalidInput(f"no shared-memory object '{key}' on this host: create it first (shm_open)") from None
        except OSError as exc:
            raise InvalidInput(f"cannot open shared-memory object '{key}': {exc.strerror}") from None
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidInput(f"'{key}' is not a shared-memory object")
            if offset + byte_size > info.st_size:
                raise InvalidInput(f"shared-memory object '{key}' holds {info.st_size} bytes; a region of "
                                   f"{byte_size} bytes at offset {offset} does not fit in it")
        except BaseException:
            os.close(descriptor)
            raise
        return SharedObject(key, descriptor)

    def unregister(self, name: str | None) -> None:
        """Forget `name` (None: every region). Requests that hold it finish with it; an unknown
        name is not an error, as in Triton."""
        self._require_allowed()
        with self._lock:
            if name is None:
                self._regions.clear()
            else:
                self._regions.pop(name, None)

    def status(self, name: str | None) -> list[dict[str, Any]]:
        self._require_allowed()
        with self._lock:
            if name is None:
                return [region.status() for region in self._regions.values()]
            return [self._get(name).status()]

    def read_inputs(self, refs: list[tuple[RegionRef, str]]) -> list[memoryview]:
        """A copy of the bytes each of a request's input references names (with what to call
        it in a refusal), bounds-checked: the request's own, whatever the client does with its
        objects meanwhile. One buffer for the request, counted once: ServerBusy when the copies
        of the requests in flight hold the bound already (a request alone is let in)."""
        for ref, what in refs:
            if ref.byte_size > self.max_input_bytes:
                self._require_allowed()
                raise InvalidInput(f"{what}: {ref.byte_size} bytes of shared memory is over the server's limit of "
                                   f"{self.max_input_bytes} bytes for one input (--max-body-bytes)")
        windows = [self._window(ref, what) for ref, what in refs]
        starts = list(itertools.accumulate((_aligned(w.byte_size) for w in windows[:-1]), initial=0))
        buffer = self._copy_buffer(starts[-1] + windows[-1].byte_size if windows else 0)
        copies = []
        for window, start in zip(windows, starts, strict=True):
            part = buffer[start:start + window.byte_size]
            window.region.shared.read_into(part, window.start)
            copies.append(part.data)
        return copies

    def _copy_buffer(self, nbytes: int) -> np.ndarray:
        """An empty buffer of `nbytes`, counted against the bound until it is freed."""
        with self._lock:
            if self.copied_bytes and self.copied_bytes + nbytes > self.max_copied_bytes:
                raise ServerBusy(f"inputs copied from shared memory for the requests in flight hold "
                                 f"{self.copied_bytes} bytes, the server's limit (--max-in-flight-bytes); "
                                 "retry after Retry-After seconds")
            self.copied_bytes += nbytes
        buffer = np.empty(nbytes, np.uint8)
        weakref.finalize(buffer, self._copy_freed, nbytes)
        return buffer

    def _copy_freed(self, nbytes: int) -> None:
        with self._lock:
            self.copied_bytes -= nbytes

    def output_targets(self, refs: Mapping[str, RegionRef]) -> dict[str, Window]:
        """Where each output asked for in shared memory goes (name -> its region reference),
        every window checked: called before any compute, so a bad reference costs no batch."""
        return {name: self._window(ref, f"output '{name}'") for name, ref in refs.items()}

    def _window(self, ref: RegionRef, what: str) -> Window:
        self._require_allowed()
        with self._lock:
            region = self._get(ref.region)
        return region.window(ref, what)

    def _get(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise InvalidInput(f"no shared-memory region '{name}' is registered")
        return region

    def _require_allowed(self) -> None:
        if not self.allowed:
            raise Unsupported(NOT_ALLOWED)


def _aligned(nbytes: int) -> int:
    """`nbytes` rounded up to 16: each input of a request starts as aligned in its buffer as
    numpy aligns its own arrays (an engine may copy one that is not)."""
    return -(-nbytes // 16) * 16


def write_outputs(outputs: Iterable[tuple[str, str, np.ndarray]], targets: Mapping[str, Window]) -> dict[str, tuple[str, int]]:
    """Write each output (name, datatype, array) that has a target into its window: name ->
    (region, bytes written), what the answer says of it in place of its data. Every output is
    checked to fit, and every object to still hold its window, before any is written: a 400
    leaves the client's memory as it was."""
    placed = [(name, targets[name], _as_bytes(array, datatype)) for name, datatype, array in outputs if name in targets]
    for name, window, data in placed:
        if data.size > window.byte_size:
            raise InvalidInput(f"output '{name}' is {data.size} bytes; its shared-memory window holds {window.byte_size}")
        window.region.shared.check_reaches(window.start + data.size)
    for _, window, data in placed:
        window.region.shared.write(data, window.start)
    return {name: (window.region.name, int(data.size)) for name, window, data in placed}


def _as_bytes(array: np.ndarray, datatype: str) -> np.ndarray:
    """An output's bytes as binary tensors lay them out (row-major; BYTES length-prefixed): a
    view of the array where its layout already is that, so writing it is the one copy."""
    if datatype == BYTES:
        return np.frombuffer(tensor_to_bytes(array, datatype), dtype=np.uint8)
    return np.ascontiguousarray(array, dtype=numpy_dtype(datatype)).reshape(-1).view(np.uint8)
