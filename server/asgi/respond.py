"""Send a whole HTTP response (status, headers and body known at once) in one write.

An ASGI response is two messages, and uvicorn writes each to the socket as it comes: two
system calls per answer, and its checks of every header name and value against a pattern. On
one core that was a tenth of the event loop's time per infer call. The server's own HTTP
protocol offers, in the request's scope (`RESPOND_EXTENSION`), a call that writes the response
in one piece, given the `send` the app was called with; any other ASGI server gets the two
messages.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from server.asgi.types import Scope, Send

# Lower-case names, values without CR or LF, content-length equal to the body's length, and no
# connection or transfer-encoding header: the protocol writes them as they are, unchecked.
Headers = list[tuple[bytes, bytes]]
Respond = Callable[[Send, int, Headers, bytes], Awaitable[None]]

RESPOND_EXTENSION = "batchline.respond"  # scope["extensions"][it](send, status, headers, body)
JSON = b"application/json"


def body_headers(body: bytes, extra: Mapping[str, str] | None = None, content_type: bytes = JSON) -> Headers:
    """A whole body's headers: its type and length, then `extra` (names lower-cased; values
    ASCII or Latin-1, as HTTP's are)."""
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra:
        headers += [(name.lower().encode(), value.encode("latin-1")) for name, value in extra.items()]
    return headers


async def send_response(scope: Scope, send: Send, status: int, headers: Headers, body: bytes) -> None:
    """Answer with `status`, `headers` (as `Headers` says: content-length among them) and
    `body`, in one write where the server offers it."""
    extensions = scope.get("extensions")
    respond: Respond | None = extensions.get(RESPOND_EXTENSION) if extensions else None
    if respond is not None:
        await respond(send, status, headers, body)
        return
    await send_messages(send, status, headers, body)


async def send_messages(send: Send, status: int, headers: Headers, body: bytes) -> None:
    """The same response as ASGI's two messages, for a server that offers no whole write."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
