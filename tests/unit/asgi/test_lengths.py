"""A declared body length, read the same way by every HTTP protocol before its body is read."""

from __future__ import annotations

import pytest

from server.asgi.lengths import TOO_LONG, declared_length


@pytest.mark.parametrize(("raw", "length"), [
    (None, None), (b"", None), (b"12", 12), (b" 12 ", 12), (b"0", 0),
    (b"-1", None), (b"1e3", None), (b"0x10", None), ("١٢".encode(), None),  # Arabic-Indic digits are not ASCII
    (b"9" * 18, int("9" * 18)), (b"9" * 19, TOO_LONG), (b"9" * 5000, TOO_LONG),  # no int() of 5000 digits
])
def test_a_declared_length_is_a_plain_non_negative_integer(raw: bytes | None, length: int | None) -> None:
    assert declared_length(raw) == length
