"""`python -m loadtest.inprocess`: the app driven in-process, directly, through the server's HTTP
protocol, through the front ends' link, or through a front end's HTTP protocol and its link,
answers every request and reports its cost, and the process's collector is left as it was. It
checks the tool, not the server's speed."""

from __future__ import annotations

import asyncio
import gc
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import server.link
from loadtest import inprocess, mlp
from server.config import load_model_config
from server.http import v2_infer
from server.layout import config_path


def _collector() -> tuple[tuple[int, int, int], int, int]:
    return gc.get_threshold(), gc.get_freeze_count(), len(gc.callbacks)


@pytest.mark.parametrize(("through", "answer"), [("app", "engine"), ("protocol", "zeros"), ("app", "parsed"),
                                                 ("protocol", "parsed"), ("link", "engine"), ("link", "zeros"),
                                                 ("plane", "zeros"), ("frontend", "zeros"), ("frontend", "engine")])
def test_a_short_run_serves_and_reports_its_cost(tmp_path: Path, through: str, answer: str) -> None:
    mlp.write_mlp_model(tmp_path)
    before, infer = _collector(), v2_infer.infer_v2
    result = asyncio.run(inprocess.measure(tmp_path, "mlp", clients=4, seconds=0.5, through=through, answer=answer))
    assert result["requests"] > 0 and result["req_s"] > 0 and result["cpu_us_per_request"] > 0
    assert (result["items_per_batch"] == 0) == (answer == "parsed"), "parsed answers never reach the batcher"
    assert _collector() == before and v2_infer.infer_v2 is infer, "the process is left as it was"


@pytest.mark.parametrize("through", ["app", "protocol", "frontend"])
def test_a_run_whose_requests_fail_says_so_and_leaves_the_process_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through: str
) -> None:
    mlp.write_mlp_model(tmp_path)
    monkeypatch.setattr(inprocess.payloads, "build_requests", lambda *args: [SimpleNamespace(body=b"{}")])
    before = _collector()
    with pytest.raises(inprocess.Failed, match="400|closed"):
        asyncio.run(inprocess.measure(tmp_path, "mlp", clients=4, seconds=0.3, through=through))
    assert _collector() == before


def test_a_link_run_whose_calls_are_refused_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlp.write_mlp_model(tmp_path)
    unknown = b'{"inputs": [{"name": "nope", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}'
    monkeypatch.setattr(inprocess.payloads, "build_requests", lambda *args: [SimpleNamespace(body=unknown)])
    before = _collector()
    with pytest.raises(inprocess.Failed, match="refused a call: unexpected input 'nope'"):
        asyncio.run(inprocess.measure(tmp_path, "mlp", clients=4, seconds=0.3, through="link"))
    assert _collector() == before


def test_a_plane_run_whose_calls_are_refused_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlp.write_mlp_model(tmp_path)
    unknown = b'{"inputs": [{"name": "nope", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}'
    monkeypatch.setattr(inprocess.payloads, "build_requests", lambda *args: [SimpleNamespace(body=unknown)])
    with pytest.raises(inprocess.Failed, match="data plane refused a call: unexpected input 'nope'"):
        asyncio.run(inprocess.measure(tmp_path, "mlp", clients=4, seconds=0.3, through="plane"))


@pytest.mark.parametrize(("through", "why"), [("link", "no HTTP to parse"), ("plane", "no HTTP to parse"),
                                              ("frontend", "parses in the front end")])
def test_a_run_that_cannot_answer_once_parsed_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], through: str, why: str,
) -> None:
    with pytest.raises(ValueError, match=why):
        asyncio.run(inprocess.measure(tmp_path, "mlp", clients=1, seconds=0.1, through=through, answer="parsed"))
    with pytest.raises(SystemExit):
        inprocess.main(["--model-repository", str(tmp_path), "--through", through, "--answer", "parsed"])
    assert why in capsys.readouterr().err


def test_a_link_run_leaves_no_socket_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlp.write_mlp_model(tmp_path)
    scratch = Path(tempfile.mkdtemp(prefix="bl-", dir="/tmp"))  # short: a Unix socket's path is bounded
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(scratch))
        asyncio.run(inprocess.measure(tmp_path, "mlp", clients=2, seconds=0.3, through="link"))
        assert list(scratch.iterdir()) == []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_call_never_answered_fails_the_run_instead_of_hanging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlp.write_mlp_model(tmp_path)
    monkeypatch.setattr(inprocess, "ANSWER_WITHIN_S", 0.5)
    answer = server.link.LinkClient.infer
    calls = 0

    async def answered_at_first(self: server.link.LinkClient, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 2:  # then a call that no answer ever comes back for
            await asyncio.Event().wait()
        return await answer(self, *args)

    monkeypatch.setattr(server.link.LinkClient, "infer", answered_at_first)
    with pytest.raises(inprocess.Failed, match="not answered within 0.5 s"):
        asyncio.run(inprocess.measure(tmp_path, "mlp", clients=2, seconds=0.3, through="link"))


def test_zeros_answer_with_the_outputs_shapes(tmp_path: Path) -> None:
    """What the zeros stand-in returns is what the model's engine would: its outputs, its rows."""
    engine = SimpleNamespace()
    config = load_model_config(config_path(mlp.write_mlp_model(tmp_path)))
    instance = SimpleNamespace(pipeline=SimpleNamespace(engine=engine))
    inprocess._answer_zeros(SimpleNamespace(config=config, instances=[instance]))
    out = engine.run({mlp.INPUT: np.ones((3, mlp.WIDTH), np.float32)})
    assert {name: (a.shape, a.dtype) for name, a in out.items()} == {"scores": ((3, mlp.CLASSES), np.float32)}
