"""`python -m loadtest.inprocess`: the app driven over ASGI without sockets answers every request
and reports its cost. It checks the tool, not the server's speed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from loadtest import inprocess, mlp


def test_a_short_run_serves_and_reports_its_cost(tmp_path: Path) -> None:
    mlp.write_mlp_model(tmp_path)
    result = asyncio.run(inprocess.measure(tmp_path, "mlp", clients=4, seconds=0.5))
    assert result["requests"] > 0 and result["req_s"] > 0 and result["cpu_us_per_request"] > 0
