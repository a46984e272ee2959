"""Structured access logs: one JSON object per infer request, with id, status and times."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.integration.conftest import access_log_lines, running_server


def test_json_access_log_lines(scratch_repository: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with running_server(scratch_repository, "--access-log", "json", "--model", "digits", log_path=log) as url:
        image = {"id": "req-42", "inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0] * 64}]}
        assert httpx.post(f"{url}/v2/models/digits/infer", json=image).status_code == 200
        image["inputs"][0]["datatype"] = "INT8"
        image["id"] = "req-43"
        assert httpx.post(f"{url}/v2/models/digits/infer", json=image).status_code == 400
        deadline = time.monotonic() + 5
        while log.read_text().count('"request_id"') < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    ok, bad = access_log_lines(log)
    assert ok["request_id"] == "req-42" and ok["status"] == 200 and ok["model"] == "digits" and ok["version"] == 1
    assert ok["path"] == "/v2/models/digits/infer"
    assert ok["duration_ms"] >= ok["compute_ms"] > 0 and ok["queue_ms"] >= 0
    assert bad["request_id"] == "req-43" and bad["status"] == 400 and bad["compute_ms"] == 0
