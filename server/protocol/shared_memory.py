"""The parameters that put a tensor in a client's shared memory instead of the request (Triton's
shared-memory extension), read the same way from HTTP's JSON and gRPC's parameter maps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from server.errors import InvalidInput, Unsupported
from server.protocol.datatypes import BYTES

NOT_TAKEN = "this caller takes no shared-memory tensors"
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"

# An input in shared memory is copied out of it (about 50 us a megabyte) where JSON is walked
# (about 20-30 us for 16 KiB): in a request's decoding cost, which decides whether it is decoded
# on the event loop or on a thread, a byte copied counts as 1/COPIED_PER_WALKED of a byte walked.
COPIED_PER_WALKED = 64


@dataclass(frozen=True, slots=True)
class RegionRef:
    """Where one tensor lies: `byte_size` bytes at `offset` into the region called `region`."""

    region: str
    byte_size: int
    offset: int = 0


# A request's inputs in shared memory (each reference, and what to call it in a refusal) -> a copy
# of each one's bytes, bounds-checked, read at once.
InputReader = Callable[[list[tuple[RegionRef, str]]], list[memoryview]]


def decoding_cost(ref: RegionRef, datatype: str) -> int:
    """What decoding an input in shared memory costs, in bytes walked: text is walked whole,
    numbers are copied (a 1/COPIED_PER_WALKED share)."""
    return ref.byte_size if datatype == BYTES else ref.byte_size // COPIED_PER_WALKED


def read_all(refs: list[tuple[RegionRef, str]], read_inputs: InputReader | None) -> Iterator[memoryview]:
    """The copies of a request's inputs in shared memory, in order; Unsupported when it names
    some and the server takes none (`read_inputs` None)."""
    if not refs:
        return iter(())
    if read_inputs is None:
        raise Unsupported(NOT_TAKEN)
    return iter(read_inputs(refs))


def region_ref(parameters: dict[str, Any], where: str) -> RegionRef | None:
    """The shared-memory reference in a tensor's parameters (None: the tensor has none); the
    same three parameters over HTTP and gRPC."""
    if REGION not in parameters and BYTE_SIZE not in parameters and OFFSET not in parameters:
        return None
    region = parameters.get(REGION)
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{where}: '{REGION}' must name a registered region, with '{BYTE_SIZE}' beside it")
    byte_size = parameters.get(BYTE_SIZE)
    offset = parameters.get(OFFSET, 0)
    if type(byte_size) is not int or byte_size < 0:
        raise InvalidInput(f"{where}: '{BYTE_SIZE}' must be a non-negative integer beside '{REGION}'")
    if type(offset) is not int or offset < 0:
        raise InvalidInput(f"{where}: '{OFFSET}' must be a non-negative integer")
    return RegionRef(region, byte_size, offset)
