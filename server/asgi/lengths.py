"""A declared body length, read once for every HTTP protocol."""

from __future__ import annotations

_MAX_DIGITS = 18  # past a quintillion bytes a length is as good as infinite; int() of 5000 digits raises
TOO_LONG = 10**_MAX_DIGITS  # what a length of more digits reads as: larger than any limit


def declared_length(raw: bytes | None) -> int | None:
    """A length header's value; None when absent or not a plain non-negative integer. A value
    of more digits than any body could have reads as TOO_LONG, without int()."""
    if raw is None:
        return None
    digits = raw.strip()
    if not digits.isdigit():  # bytes.isdigit is ASCII digits only
        return None
    return int(digits) if len(digits) <= _MAX_DIGITS else TOO_LONG
