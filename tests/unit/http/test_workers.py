"""The pieces of `--http-workers` that need no second process: the settings a front end is
sent, the port's SO_REUSEPORT group, the server process's app on a Unix socket, a front end's
door (no queues to refuse from), and a forward to a server process that does not answer."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from pydantic import SecretStr

from server.asgi import body
from server.http import workers
from server.http.door import Admitted, Door, Refused
from server.http.forward import UNREACHABLE, ForwardApp
from server.http.frontend import HttpFrontEnd
from server.http.shared_port import reserve_port, reuse_port_socket
from server.http.worker_process import front_end_app
from server.http.workers import HttpWorkers, _settings_json
from server.settings import ServerSettings
from tests.unit.http.conftest import Exchange


def test_a_front_end_gets_the_settings_secrets_included(tmp_path: Path) -> None:
    settings = ServerSettings(model_repository=tmp_path, http_workers=3, inference_token=SecretStr("s3cret-token-value"),
                              models=["a"], max_in_flight=10)
    sent = ServerSettings(**orjson.loads(_settings_json(settings)))
    assert sent == settings
    assert sent.inference_token is not None and sent.inference_token.get_secret_value() == "s3cret-token-value"


def test_a_port_already_held_is_refused() -> None:
    with socket.create_server(("127.0.0.1", 0)) as other_server, pytest.raises(OSError):
        reserve_port("127.0.0.1", other_server.getsockname()[1])
    holder = reserve_port("127.0.0.1", 0)
    front = reuse_port_socket("127.0.0.1", holder.getsockname()[1], listen=True)
    try:
        with pytest.raises(OSError):  # a second server with workers on the port of one serving fails too
            reserve_port("127.0.0.1", holder.getsockname()[1])
    finally:
        front.close()
        holder.close()


def test_front_ends_share_the_port_and_the_holder_takes_no_connections() -> None:
    holder = reserve_port("127.0.0.1", 0)
    port = holder.getsockname()[1]
    front = reuse_port_socket("127.0.0.1", port, listen=True)
    other = reuse_port_socket("127.0.0.1", port, listen=True)
    try:
        with pytest.raises(OSError):  # a server without the option cannot take the port
            socket.create_server(("127.0.0.1", port))
        for _ in range(20):  # every connection lands on a listening socket, never on the holder
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
    finally:
        for sock in (holder, front, other):
            sock.close()


def test_a_front_ends_door_refuses_only_what_it_can_judge(tmp_path: Path) -> None:
    settings = ServerSettings(model_repository=tmp_path, http_workers=2, max_in_flight=2)
    app = front_end_app(settings, link=None, forward=ForwardApp(str(tmp_path / "none.sock")), workers=2)  # type: ignore[arg-type]
    door = Door.of(app)
    assert door is not None
    scope = Exchange.of(b"{}").scope
    # no queue here to look at: the server process refuses there
    assert isinstance(door.decide(scope), Admitted)
    endpoint = app.app.endpoint  # type: ignore[attr-defined]
    assert endpoint.flight.try_hold(0) is not None  # this front end's share of 2 in flight is 1
    refused = door.decide(scope)
    assert isinstance(refused, Refused) and refused.retry_after == "1"


async def test_the_server_process_app_serves_on_a_unix_socket(tmp_path: Path) -> None:
    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "app.sock"))
    listener.listen()
    frontend = HttpFrontEnd(app, listener, "warning", grace_s=1)
    await frontend.start()
    try:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(tmp_path / "app.sock"))) as client:
            assert (await client.get("http://batchline/anything")).text == "ok"
    finally:
        await frontend.drain()


async def test_a_forward_to_a_server_process_that_does_not_answer_is_a_503(tmp_path: Path) -> None:
    forward = ForwardApp(str(tmp_path / "gone.sock"))
    exchange = Exchange([], path="/v2/health/ready")
    exchange.scope["method"] = "GET"
    await asyncio.wait_for(forward(exchange.scope, exchange.receive, exchange.send), 10)
    assert exchange.sent[0]["status"] == 503
    assert orjson.loads(exchange.sent[1]["body"]) == {"error": UNREACHABLE}
    await forward.close()


async def forwarding_to(app: Any, tmp_path: Path) -> tuple[HttpFrontEnd, ForwardApp]:
    """A server process's own HTTP app, `app`, on a Unix socket, and a front end's forward to it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "app.sock"))
    listener.listen()
    server_process = HttpFrontEnd(app, listener, "warning", grace_s=1)
    await server_process.start()
    return server_process, ForwardApp(str(tmp_path / "app.sock"))


async def test_a_forwarded_body_that_stops_part_way_is_a_408_that_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A front end passes a body on as it comes (/v1, the control plane): one that stops coming
    is refused there, in the route's shape, as the server process would, and its connection closed."""
    monkeypatch.setattr(body, "BODY_IDLE_TIMEOUT_S", 0.2)

    async def reads_it_all(scope: dict, receive: Any, send: Any) -> None:  # type: ignore[type-arg]
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    server_process, forward = await forwarding_to(reads_it_all, tmp_path)
    try:
        stalled = Exchange([{"type": "http.request", "body": b'{"model": ', "more_body": True}],
                           path="/v1/embeddings")
        await asyncio.wait_for(forward(stalled.scope, stalled.receive, stalled.send), 10)
        assert stalled.sent[0]["status"] == 408
        assert (b"connection", b"close") in [(k.lower(), v) for k, v in stalled.sent[0]["headers"]]
        error = orjson.loads(stalled.sent[1]["body"])["error"]  # in OpenAI's shape, as the server process answers
        assert "no part of the request body came" in error["message"] and error["type"] == "invalid_request_error"
    finally:
        await forward.close()
        await server_process.drain()


async def test_a_client_that_leaves_part_way_through_a_forwarded_body_is_never_passed_on_as_whole(
    tmp_path: Path,
) -> None:
    """Without a declared length (chunked), a body cut short would otherwise end as if it were
    complete: the server process must see the connection close instead."""
    received: list[dict[str, Any]] = []
    ended = asyncio.Event()

    async def records(scope: dict, receive: Any, send: Any) -> None:  # type: ignore[type-arg]
        while True:
            message = await receive()
            received.append(message)
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                ended.set()
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    server_process, forward = await forwarding_to(records, tmp_path)
    try:
        for declared in ({}, {"content-length": "100"}):
            received.clear()
            ended.clear()
            leaving = Exchange([{"type": "http.request", "body": b'{"parameters": ', "more_body": True},
                                {"type": "http.disconnect"}], declared, path="/v2/repository/models/m/load")
            await asyncio.wait_for(forward(leaving.scope, leaving.receive, leaving.send), 10)
            assert leaving.sent == []  # nobody to answer
            await asyncio.wait_for(ended.wait(), 10)
            assert received[-1]["type"] == "http.disconnect", received
    finally:
        await forward.close()
        await server_process.drain()


async def test_a_silent_front_end_is_killed_and_a_stall_here_kills_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """One that sends no heartbeat is killed; one whose heartbeats wait in the pipe while this
    process's own loop stalls past the limit is left alone."""
    monkeypatch.setattr(workers, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(workers, "SILENT_S", 0.5)
    beats = "import sys, time\nwhile True:\n    sys.stdout.write('.'); sys.stdout.flush(); time.sleep(0.05)"
    beating, silent = [await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE)
                       for code in (beats, "import time; time.sleep(60)")]
    front_ends = HttpWorkers(ServerSettings(model_repository=tmp_path), None, 0, 2, "", "")  # type: ignore[arg-type]
    listening = [asyncio.create_task(front_ends._listen(i, p)) for i, p in enumerate((beating, silent))]
    try:
        await asyncio.sleep(0.2)
        time.sleep(1.0)  # noqa: ASYNC251 (this loop stalls for twice the limit, on purpose)
        assert await asyncio.wait_for(silent.wait(), 10) == -signal.SIGKILL
        await asyncio.sleep(0.5)
        assert beating.returncode is None and not listening[0].done()
    finally:
        for task in listening:
            task.cancel()
        for process in (beating, silent):
            if process.returncode is None:
                process.kill()
            await process.wait()
