"""Triton's system shared-memory extension: tensors that live in a client's POSIX shared memory.

A client on the same host creates a shared-memory object (`shm_open`: /dev/shm/KEY), registers
part of it under a name, and then names that region (with an offset and a byte size) in place
of an input's data, or as where an output goes. The tensor then never travels in the request or
the answer: the server maps the object once, reads inputs from it without a copy and writes
outputs into it. `tritonclient.utils.shared_memory` makes and fills such objects.

Every reference is checked against its region's bounds, and every region against its object's
size, before any work. A region that is unregistered while a request uses it stays mapped until
that request lets go of it (the arrays and views hold the mapping), so unregistering never pulls
memory from under a running batch; new requests no longer find it.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.errors import InvalidInput, Unsupported
from server.protocol.binary import tensor_to_bytes
from server.protocol.datatypes import BYTES, numpy_dtype
from server.protocol.shared_memory import RegionRef

SHM_FOLDER = "/dev/shm"  # where Linux keeps POSIX shared-memory objects
MAX_REGIONS = 1024  # each region is one mapping; the kernel allows ~65k per process in all
_KEY = re.compile(r"/?[^/\x00]{1,255}")
NOT_ALLOWED = ("this server does not take client shared memory; start it with --allow-client-shm "
               "(BATCHLINE_ALLOW_CLIENT_SHM=1) to let same-host clients register regions")

@dataclass(frozen=True, slots=True)
class Region:
    """A registered region: `byte_size` bytes at `offset` into the object `key`, mapped."""

    name: str
    key: str
    offset: int
    byte_size: int
    view: memoryview  # the region's bytes, writable; it keeps the mapping alive

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def window(self, ref: RegionRef, what: str) -> memoryview:
        """The bytes `ref` names, after checking they lie inside this region."""
        if ref.offset + ref.byte_size > self.byte_size:
            raise InvalidInput(
                f"{what}: {ref.byte_size} bytes at offset {ref.offset} run past the end of shared-memory region "
                f"'{self.name}' ({self.byte_size} bytes)")
        return self.view[ref.offset:ref.offset + ref.byte_size]


class SystemSharedMemory:
    """The regions clients registered, by name. Thread-safe: front ends and worker threads
    (which decode big requests) look regions up while control calls change the table."""

    def __init__(self, allowed: bool = False, max_input_bytes: int = 64 << 20, folder: str = SHM_FOLDER) -> None:
        """`max_input_bytes`: the most one input may take from a region (the server's body limit:
        a request's tensors are copied into its batch, whichever way they came)."""
        self.allowed = allowed
        self.max_input_bytes = max_input_bytes
        self._folder = folder
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

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
        view = self._map(key, offset, byte_size)
        with self._lock:  # again: a concurrent call may have registered meanwhile
            self._check_room(name)
            self._regions[name] = Region(name, key, offset, byte_size, view)

    def _check_room(self, name: str) -> None:
        """Under the lock: the name is free and a region more fits."""
        if name in self._regions:
            raise InvalidInput(f"shared-memory region '{name}' is already registered; unregister it first")
        if len(self._regions) >= MAX_REGIONS:
            raise InvalidInput(f"{MAX_REGIONS} shared-memory regions are registered already; unregister some")

    def _map(self, key: str, offset: int, byte_size: int) -> memoryview:
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
            start = offset - offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
            try:
                mapping = mmap.mmap(descriptor, offset + byte_size - start, offset=start)
            except OSError as exc:  # e.g. the process's limit on mappings
                raise InvalidInput(f"cannot map shared-memory object '{key}': {exc.strerror}") from None
        finally:
            os.close(descriptor)  # the mapping stays valid without it
        return memoryview(mapping)[offset - start:]

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

    def input_window(self, ref: RegionRef, what: str) -> memoryview:
        """The bytes an input's reference names, bounds-checked and read-only (an engine that
        worked in place on its input would change the client's memory); the view keeps the
        region mapped."""
        if ref.byte_size > self.max_input_bytes:
            self._require_allowed()
            raise InvalidInput(f"{what}: {ref.byte_size} bytes of shared memory is over the server's limit of "
                               f"{self.max_input_bytes} bytes for one input (--max-body-bytes)")
        return self._window(ref, what).toreadonly()

    def output_window(self, ref: RegionRef, what: str) -> memoryview:
        """The bytes an output's reference names, bounds-checked and writable."""
        return self._window(ref, what)

    def output_targets(self, refs: Mapping[str, RegionRef]) -> dict[str, Target]:
        """Where each output asked for in shared memory goes (name -> its region reference),
        every window checked: called before any compute, so a bad reference costs no batch."""
        return {name: (ref.region, self.output_window(ref, f"output '{name}'")) for name, ref in refs.items()}

    def _window(self, ref: RegionRef, what: str) -> memoryview:
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


Target = tuple[str, memoryview]  # an output's region name and its window there


def write_outputs(outputs: Iterable[tuple[str, str, np.ndarray]], targets: Mapping[str, Target]) -> dict[str, tuple[str, int]]:
    """Write each output (name, datatype, array) that has a target into its window: name ->
    (region, bytes written), what the answer says of it in place of its data. Every output is
    checked to fit before any is written: a 400 leaves the client's memory as it was."""
    placed = [(name, targets[name], _as_bytes(array, datatype)) for name, datatype, array in outputs if name in targets]
    for name, (_, window), data in placed:
        if data.size > window.nbytes:
            raise InvalidInput(f"output '{name}' is {data.size} bytes; its shared-memory window holds {window.nbytes}")
    for _, (_, window), data in placed:
        np.frombuffer(window, dtype=np.uint8, count=data.size)[:] = data
    return {name: (region, int(data.size)) for name, (region, _), data in placed}


def _as_bytes(array: np.ndarray, datatype: str) -> np.ndarray:
    """An output's bytes as binary tensors lay them out (row-major; BYTES length-prefixed): a
    view of the array where its layout already is that, so writing it is the one copy."""
    if datatype == BYTES:
        return np.frombuffer(tensor_to_bytes(array, datatype), dtype=np.uint8)
    return np.ascontiguousarray(array, dtype=numpy_dtype(datatype)).reshape(-1).view(np.uint8)
