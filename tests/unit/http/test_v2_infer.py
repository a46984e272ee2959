"""Which outputs a v2 call gets back as binary data: each output's own `binary_data`, else the
request's `binary_data_output` (Triton's binary tensor extension)."""

from __future__ import annotations

import numpy as np
import pytest

from server.http.v2_infer import with_binary_flags
from server.protocol.v2 import DecodedRequest, RequestedOutput

SCORES = ("scores", "FP32", np.zeros((1, 2), np.float32))
LABEL = ("label", "BYTES", np.array([[b"a"]], dtype=object))


def request(outputs: list[RequestedOutput] | None, binary_output: bool = False) -> DecodedRequest:
    return DecodedRequest(id=None, parameters={}, inputs={}, outputs=outputs, binary_output=binary_output)


def flags(tensors: list[tuple[str, str, np.ndarray, bool]]) -> list[tuple[str, bool]]:
    return [(name, binary) for name, _, _, binary in tensors]


@pytest.mark.parametrize("binary_output", [False, True])
def test_every_output_follows_the_request_by_default(binary_output: bool) -> None:
    tensors = with_binary_flags([SCORES, LABEL], request(None, binary_output))
    assert flags(tensors) == [("scores", binary_output), ("label", binary_output)]
    assert tensors[0][2] is SCORES[2], "the arrays pass through untouched"


def test_an_outputs_own_flag_wins() -> None:
    wanted = [RequestedOutput("label", None), RequestedOutput("scores", True)]
    assert flags(with_binary_flags([LABEL, SCORES], request(wanted))) == [("label", False), ("scores", True)]
    wanted = [RequestedOutput("label", False), RequestedOutput("scores", None)]
    assert flags(with_binary_flags([LABEL, SCORES], request(wanted, True))) == [("label", False), ("scores", True)]
