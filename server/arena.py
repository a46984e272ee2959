"""A shared-memory arena between two processes of one server: large tensors cross in it.

One process owns an arena: it creates the file, allocates and frees its slots, and names slots
to its peer, which maps the same file once and reads or writes only the slots it is named. A
tensor in a slot crosses with one copy in (and none through a pipe) instead of the three a
socket costs, which is what makes an image model's tensors cheap to move between processes.

Slots come in power-of-two sizes with a free list each, so allocating and freeing cost a dict
lookup. Memory carved for one size is kept for that size, until the arena is full: the free
slots above the highest one in use are then uncarved. The whole arena is reserved at
creation (`posix_fallocate`), so a /dev/shm too small for it (a container's default is 64 MiB)
is an error at start, never a SIGBUS when a page is first touched. A full arena is no error:
`allocate` answers None and the caller sends that tensor another way.
"""

from __future__ import annotations

import mmap
import os
import secrets

SHM_FOLDER = "/dev/shm"
MIN_SLOT = 64 << 10  # below this, a tensor's bytes cost less to send inline than a slot costs to keep


class Arena:
    """A mapped shared-memory file and, for its owner, the slots handed out."""

    def __init__(self, path: str, mapping: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.size = len(mapping)
        self.view = memoryview(mapping)
        self._mapping = mapping
        self._owner = owner
        self._top = 0  # memory below this is carved into slots
        self._slot_sizes: dict[int, int] = {}  # offset -> its slot's size
        self._free: dict[int, list[int]] = {}  # slot size -> offsets free to reuse
        self._in_use: set[int] = set()

    @classmethod
    def create(cls, size: int, prefix: str = "batchline") -> Arena:
        """A new arena of `size` bytes, reserved whole: OSError when /dev/shm cannot hold it.
        Its file is removed once the peer has mapped it (`forget_file`)."""
        path = os.path.join(SHM_FOLDER, f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(path, mapping, owner=True)

    @classmethod
    def attach(cls, path: str) -> Arena:
        """The peer's side: map the owner's arena by its path."""
        if os.path.dirname(path) != SHM_FOLDER:
            raise OSError(f"{path} is not a shared-memory file")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mapping, owner=False)

    def forget_file(self) -> None:
        """Remove the file once both sides have mapped it: nothing is left in /dev/shm if either
        process dies, and the memory goes when the last mapping does."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a free slot of at least `nbytes`, or None when the arena is full."""
        size = max(MIN_SLOT, 1 << (nbytes - 1).bit_length())
        free = self._free.get(size)
        if free:
            offset = free.pop()
        elif self._top + size <= self.size or self._trimmed() and self._top + size <= self.size:
            offset = self._top
            self._top += size
            self._slot_sizes[offset] = size
        else:
            return None
        self._in_use.add(offset)
        return offset

    def _trimmed(self) -> bool:
        """Uncarve the free slots above the highest one in use, to be carved again in any size
        (else one 17 MiB tensor's 32 MiB slot, freed, would be all the arena ever holds again);
        True if that lowered the top. Only when the arena is full: it reads every slot."""
        top = max((offset + self._slot_sizes[offset] for offset in self._in_use), default=0)
        if top == self._top:
            return False
        for size, offsets in self._free.items():
            self._free[size] = [offset for offset in offsets if offset < top]
        for offset in [offset for offset in self._slot_sizes if offset >= top]:
            del self._slot_sizes[offset]
        self._top = top
        return True

    def free(self, offset: int) -> None:
        """Give a slot back; an offset not handed out now is ignored (a slot freed twice would
        be handed to two tensors at once)."""
        if offset in self._in_use:
            self._in_use.remove(offset)
            self._free.setdefault(self._slot_sizes[offset], []).append(offset)

    def slot(self, offset: int, nbytes: int) -> memoryview:
        """The `nbytes` at `offset`, checked to lie inside the arena (a peer's offsets are
        never trusted blindly)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"{nbytes} bytes at offset {offset} run past the arena's {self.size} bytes")
        return self.view[offset:offset + nbytes]
