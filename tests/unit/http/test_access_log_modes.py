"""The access log in each mode, at the ASGI level: off writes nothing, text one readable line,
json one object with the documented fields, for successes, errors and clients that leave."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from server.access_log import MAX_LOGGED_CHARS, AccessLog, AccessLogFormat
from server.dataplane import DataPlane
from server.http.infer import FastInferApp, InferEndpoint
from tests.unit.http.conftest import HOLD, Exchange, Gate, infer_body
from tests.unit.waiting import eventually

ACCESS = logging.getLogger("batchline.access")
JSON_FIELDS = {"time", "client", "method", "path", "model", "version", "status", "request_id",
               "duration_ms", "queue_ms", "compute_ms"}


@pytest.fixture(autouse=True)
def restore_access_logger() -> Iterator[None]:
    """json mode configures the process-wide access logger; leave it as it was found."""
    saved = (list(ACCESS.handlers), ACCESS.propagate, ACCESS.level)
    yield
    ACCESS.handlers, ACCESS.propagate = saved[0], saved[1]
    ACCESS.setLevel(saved[2])


def app_with(plane: DataPlane, mode: AccessLogFormat) -> FastInferApp:
    async def unreachable(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the infer endpoint should have answered")

    return FastInferApp(unreachable, InferEndpoint(plane, 1 << 20, AccessLog(mode)))


async def call(app: FastInferApp, exchange: Exchange) -> Exchange:
    await asyncio.wait_for(app(exchange.scope, exchange.receive, exchange.send), 30)
    return exchange


def json_lines(err: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in err.splitlines() if line.startswith("{")]


def bad_datatype(request_id: str) -> bytes:
    return orjson.dumps({"id": request_id, "inputs": [{"name": "x", "shape": [1, 1], "datatype": "INT8", "data": [1]}]})


async def test_off_writes_no_line(plane: DataPlane, caplog: pytest.LogCaptureFixture,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)
    app = app_with(plane, "off")
    assert (await call(app, Exchange.of(infer_body(1.0)))).status == 200
    assert (await call(app, Exchange.of(bad_datatype("bad")))).status == 400
    assert [r for r in caplog.records if r.name == ACCESS.name] == []
    assert capsys.readouterr().err == ""


async def test_text_writes_one_line_per_request(plane: DataPlane, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS.name)
    app = app_with(plane, "text")
    assert (await call(app, Exchange.of(infer_body(1.0)))).status == 200
    assert (await call(app, Exchange.of(bad_datatype("bad-one")))).status == 400
    ok, bad = [r.getMessage() for r in caplog.records if r.name == ACCESS.name]
    assert ok.startswith('127.0.0.1:50000 "POST /v2/models/spin/infer" 200 ')
    assert "model=spin version=1 id=req" in ok and "queue=" in ok and "compute=" in ok
    assert bad.startswith('127.0.0.1:50000 "POST /v2/models/spin/infer" 400 ') and "id=bad-one" in bad


async def test_text_escapes_what_the_client_controls(plane: DataPlane, caplog: pytest.LogCaptureFixture) -> None:
    """A request id or a (percent-decoded) path with a line break must not forge a log line."""
    caplog.set_level(logging.INFO, logger=ACCESS.name)
    app = app_with(plane, "text")
    forged = 'x\n10.0.0.1:1 "POST /v2/models/spin/infer" 200 0.1ms'
    body = orjson.dumps({"id": forged, "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}]})
    assert (await call(app, Exchange.of(body))).status == 200
    path = "/v2/models/spin\r\n10.0.0.1:1 \"GET x\" 200/infer"
    assert (await call(app, Exchange.of(infer_body(1.0), path=path))).status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS.name]
    assert len(lines) == 2
    for line in lines:
        assert "\n" not in line and "\r" not in line, line
    assert "id=x\\n10.0.0.1:1" in lines[0]


async def test_json_has_the_documented_fields_for_success_and_error(
    plane: DataPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    app = app_with(plane, "json")
    assert (await call(app, Exchange.of(infer_body(3.0)))).status == 200
    assert (await call(app, Exchange.of(bad_datatype("bad-two")))).status == 400
    ok, bad = json_lines(capsys.readouterr().err)
    assert set(ok) == set(bad) == JSON_FIELDS
    assert ok["client"] == "127.0.0.1:50000" and ok["method"] == "POST" and ok["path"] == "/v2/models/spin/infer"
    assert ok["model"] == "spin" and ok["version"] == 1 and ok["status"] == 200 and ok["request_id"] == "req"
    assert ok["compute_ms"] > 0 and ok["queue_ms"] >= 0
    assert ok["duration_ms"] >= ok["queue_ms"] + ok["compute_ms"] - 0.002  # rounded to microseconds
    assert isinstance(ok["time"], float)
    assert bad["status"] == 400 and bad["request_id"] == "bad-two" and bad["version"] == 1
    assert bad["compute_ms"] == 0 and bad["queue_ms"] == 0


async def test_what_the_client_controls_is_logged_up_to_a_bound(
    plane: DataPlane, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    """A request id of 60 MB made each of its lines 60 MB: what the client sent is logged up to
    MAX_LOGGED_CHARS, then its length. The answer still carries the id whole."""
    caplog.set_level(logging.INFO, logger=ACCESS.name)
    path = "/v2/models/" + "m" * 5000 + "/infer"
    assert (await call(app_with(plane, "text"), Exchange.of(infer_body(1.0), path=path))).status == 404
    (text,) = [r.getMessage() for r in caplog.records if r.name == ACCESS.name]
    assert len(text) < 3 * MAX_LOGGED_CHARS and "...(5017 characters)" in text
    long_id = "i" * 100_000
    body = orjson.dumps({"id": long_id, "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}]})
    answered = await call(app_with(plane, "json"), Exchange.of(body))  # json: the logger's own handler
    assert answered.status == 200 and answered.json()["id"] == long_id
    (line,) = json_lines(capsys.readouterr().err)
    assert line["request_id"] == "i" * MAX_LOGGED_CHARS + "...(100000 characters)"


async def test_json_logs_errors_the_edge_answers_itself(plane: DataPlane, capsys: pytest.CaptureFixture[str]) -> None:
    app = app_with(plane, "json")
    too_large = Exchange([], {"content-length": str(2 << 20)})
    assert (await call(app, too_large)).status == 413
    assert (await call(app, Exchange.of(infer_body(1.0), {"content-encoding": "br"}))).status == 400
    first, second = json_lines(capsys.readouterr().err)
    assert (first["status"], first["request_id"], first["version"]) == (413, None, None)
    assert second["status"] == 400 and second["model"] == "spin"


async def test_a_client_that_leaves_is_logged_as_499(
    plane: DataPlane, gate: Gate, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line per request, as documented: a request whose client disconnected while it was
    queued still gets its line (nginx's 499), so dropped work shows in the log."""
    app = app_with(plane, "json")
    model = plane.repository.get("spin")
    busy = Exchange.of(infer_body(HOLD))
    busy_task = asyncio.create_task(call(app, busy))
    await eventually(gate.held.is_set, "the first request holds the only instance")
    leaving = Exchange.of(infer_body(5.0))
    leaving_task = asyncio.create_task(call(app, leaving))
    await eventually(lambda: model.queue_depth == 1 and leaving.receive_calls == 2, "the second request waits, watched")
    leaving.disconnect()
    await leaving_task
    halfway = Exchange([{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}])
    await call(app, halfway)
    gate.released.set()
    await busy_task
    assert leaving.sent == [] and halfway.sent == []
    statuses = sorted(line["status"] for line in json_lines(capsys.readouterr().err))
    assert statuses == [200, 499, 499]


async def test_json_keeps_the_request_id_when_the_model_is_unknown(
    plane: DataPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    """The id was decoded before the lookup failed: the line for a 404 should carry it, so a
    client's report of a failed request can be found in the log."""
    app = app_with(plane, "json")
    assert (await call(app, Exchange.of(infer_body(1.0), path="/v2/models/nosuch/infer"))).status == 404
    (line,) = json_lines(capsys.readouterr().err)
    assert line["status"] == 404 and line["request_id"] == "req"
