"""The HTTP floor of the server's stack: a bare ASGI app on uvicorn, httptools and uvloop.

For each POST it reads the body, parses its JSON, builds every input's array (as a v2 server
must before it can batch anything), and answers a v2 answer of zeros, ten a row (the MLP's
`scores`), encoded once per row count. No model, no queue, no checks: what any Python server on
this stack spends per request before it does its own work. uvicorn runs as the server runs it
(no lifespan, no X-Forwarded-For layer, no access log), so the floor is this stack's cheapest.
GET answers 200 (readiness).

    python -m loadtest.bareapp --port-file FILE    (binds 127.0.0.1 on a free port, writes it to FILE)

`bench floor` serves it beside the server, in turn on one core.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import uvicorn

from loadtest import mlp
from server.port_file import write_port_file

_JSON = [(b"content-type", b"application/json")]
_answers: dict[tuple[str, int], bytes] = {}


def _answer(model: str, rows: int) -> bytes:
    body = _answers.get((model, rows))
    if body is None:
        body = _answers[model, rows] = orjson.dumps({
            "model_name": model,
            "outputs": [{"name": "scores", "datatype": "FP32", "shape": [rows, mlp.CLASSES],
                         "data": [0.0] * (rows * mlp.CLASSES)}]})
    return body


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["method"] != "POST":
        await _send(send, 200, b"")
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    rows = 0
    for tensor in orjson.loads(body)["inputs"]:
        rows = np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"]).shape[0]
    model = scope["path"].split("/")[3] if scope["path"].startswith("/v2/models/") else ""
    await _send(send, 200, _answer(model, rows))


async def _send(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bareapp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port-file", type=Path, required=True, help="where the port it listens on is written")
    args = parser.parse_args(argv)
    listener = socket.create_server(("127.0.0.1", 0), backlog=2048)
    write_port_file(args.port_file, listener.getsockname()[1])
    config = uvicorn.Config(app, http="httptools", loop="uvloop", lifespan="off", proxy_headers=False,
                            access_log=False, log_level="warning")
    uvicorn.Server(config).run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
