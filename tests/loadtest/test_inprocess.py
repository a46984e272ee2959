"""`python -m loadtest.inprocess`: the app driven without sockets, directly or through the
server's HTTP protocol, answers every request and reports its cost, and the process's collector
is left as it was. It checks the tool, not the server's speed."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

from types import SimpleNamespace

import numpy as np
import pytest

from loadtest import inprocess, mlp
from server.config import load_model_config
from server.layout import config_path


@pytest.mark.parametrize(("through", "answer"), [("app", "engine"), ("protocol", "zeros"), ("app", "parsed"),
                                                 ("protocol", "parsed")])
def test_a_short_run_serves_and_reports_its_cost(tmp_path: Path, through: str, answer: str) -> None:
    mlp.write_mlp_model(tmp_path)
    thresholds = gc.get_threshold()
    result = asyncio.run(inprocess.measure(tmp_path, "mlp", clients=4, seconds=0.5, through=through, answer=answer))
    assert result["requests"] > 0 and result["req_s"] > 0 and result["cpu_us_per_request"] > 0
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0


def test_zeros_answer_with_the_outputs_shapes(tmp_path: Path) -> None:
    """What the zeros stand-in returns is what the model's engine would: its outputs, its rows."""
    engine = SimpleNamespace()
    config = load_model_config(config_path(mlp.write_mlp_model(tmp_path)))
    instance = SimpleNamespace(pipeline=SimpleNamespace(engine=engine))
    inprocess._answer_zeros(SimpleNamespace(config=config, instances=[instance]))
    out = engine.run({mlp.INPUT: np.ones((3, mlp.WIDTH), np.float32)})
    assert {name: (a.shape, a.dtype) for name, a in out.items()} == {"scores": ((3, mlp.CLASSES), np.float32)}
