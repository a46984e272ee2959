"""Every HTTP route but infer, in a front-end process (`--http-workers`): sent on unchanged to
the server process's own HTTP app over a private Unix socket.

So metadata, readiness, statistics, /metrics, model control, shared-memory registration, /v1
and the docs have one answer whichever front end a client reaches: the state they read lives in
the server process alone. Only infer, the hot path, is decoded in the front end.
"""

from __future__ import annotations

import httpx

from server.asgi.body import body_parts
from server.asgi.respond import body_headers, send_messages
from server.asgi.types import Receive, Scope, Send
from server.errors import BatchlineError, Cancelled, Unavailable
from server.http.errors import error_parts
from server.openai import PREFIX as OPENAI_PREFIX
from server.openai.errors import error_parts as openai_error_parts

# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection, never passed on; this front
# end's uvicorn writes its own Date and Server.
_NOT_PASSED_ON = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                            b"transfer-encoding", b"upgrade"})
_ANSWERED_HERE = frozenset({b"date", b"server"})
UNREACHABLE = "the server process does not answer; retry"
# Idle connections to the server process close well before its uvicorn closes them (5 s), so a
# request never goes out on a connection the other side is closing.
_POOL = httpx.Limits(keepalive_expiry=1.0)
_SAFE = ("GET", "HEAD", "OPTIONS")  # sent again once when a pooled connection fails; their body is not passed on
_BODY_FRAMING = frozenset({b"content-length", b"content-encoding", b"expect"})  # of a body: not for one left here


class ForwardApp:
    def __init__(self, socket_path: str) -> None:
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=socket_path, limits=_POOL), base_url="http://batchline", timeout=None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        method = scope["method"]
        headers = [(k, v) for k, v in scope["headers"]
                   if k not in _NOT_PASSED_ON and not (method in _SAFE and k in _BODY_FRAMING)]
        url = httpx.URL("http://batchline").copy_with(raw_path=target)
        try:
            try:
                response = await self._client.send(self._client.build_request(
                    method, url, headers=headers, content=None if method in _SAFE else body_parts(receive)), stream=True)
            except httpx.TransportError:
                if method not in _SAFE:
                    raise
                response = await self._client.send(self._client.build_request(method, url, headers=headers), stream=True)
        except httpx.TransportError:
            await _error(scope, send, Unavailable(UNREACHABLE))
            return
        except Cancelled:  # the client left while sending the body: nobody to answer
            return
        except BatchlineError as exc:  # the body passed a limit (413) or stopped coming (408) as it was read
            await _error(scope, send, exc)
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw
                                    if k.lower() not in _NOT_PASSED_ON and k.lower() not in _ANSWERED_HERE]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    async def close(self) -> None:
        await self._client.aclose()


async def _error(scope: Scope, send: Send, error: Exception) -> None:
    """In the route's error shape (OpenAI's under /v1), as ASGI's messages, so the server honours
    a `Connection: close` among the headers (a body that stopped part-way)."""
    status, body, extra = (openai_error_parts if scope["path"].startswith(f"{OPENAI_PREFIX}/") else error_parts)(error)
    await send_messages(send, status, body_headers(body, extra), body)
