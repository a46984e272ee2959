"""Every HTTP route but infer, in a front-end process (`--http-workers`): sent on unchanged to
the server process's own HTTP app over a private Unix socket.

So metadata, readiness, statistics, /metrics, model control, shared-memory registration and the
docs have one answer whichever front end a client reaches: the state they read lives in the
server process alone. Only infer, the hot path, is decoded in the front end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from server.http.errors import error_parts
from server.http.infer import Receive, Scope, Send
from server.errors import Unavailable

# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection, never passed on.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                         b"transfer-encoding", b"upgrade"})
UNREACHABLE = "the server process does not answer; retry"


class ForwardApp:
    def __init__(self, socket_path: str) -> None:
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=socket_path), base_url="http://batchline", timeout=None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP_BY_HOP]
        request = self._client.build_request(
            scope["method"], httpx.URL("http://batchline").copy_with(raw_path=target), headers=headers,
            content=_body(receive) if scope["method"] not in ("GET", "HEAD") else None)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TransportError:
            status, body, extra = error_parts(Unavailable(UNREACHABLE))
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                    *((k.lower().encode(), v.encode()) for k, v in extra.items())]})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    async def close(self) -> None:
        await self._client.aclose()


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return
