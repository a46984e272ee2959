"""Access logs for infer calls, over every front end: one line per request, as text or as JSON.

Off by default: a log line per request costs more than a small model's inference. JSON lines
go to their own handler (message only), so log shippers get one JSON object per line.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Literal

import orjson

from server.scheduler.request import RequestRecord

AccessLogFormat = Literal["off", "text", "json"]
logger = logging.getLogger("batchline.access")

# Text lines carry client-controlled strings (the percent-decoded path, the request id): a line
# break or quote in them would forge or garble lines, so they are written escaped. JSON escapes.
_BREAKS = [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029]
_TEXT_ESCAPES = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _BREAKS} | {
    ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", ord('"'): '\\"', ord("\\"): "\\\\",
}


# A client-controlled string is logged up to this many characters, then how long it was: a
# request id of 60 MB made each of its lines 60 MB.
MAX_LOGGED_CHARS = 256


def _clipped(value: str) -> str:
    if len(value) <= MAX_LOGGED_CHARS:
        return value
    return f"{value[:MAX_LOGGED_CHARS]}...({len(value)} characters)"


def _escaped(value: object) -> str:
    return str(value).translate(_TEXT_ESCAPES)


class AccessLog:
    def __init__(self, format: AccessLogFormat = "off") -> None:
        self.format = format
        if format == "json":
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.handlers = [handler]
            logger.propagate = False
            logger.setLevel(logging.INFO)

    @property
    def enabled(self) -> bool:
        return self.format != "off"

    def write(
        self, client: str, path: str, model: str, status: int, started_ns: int, record: RequestRecord,
        method: str = "POST",
    ) -> None:
        """One line; over gRPC `method` is "GRPC", `path` the RPC's and `status` its status code."""
        duration_ms = (time.perf_counter_ns() - started_ns) / 1e6
        queue_ms, compute_ms = record.queue_ns / 1e6, record.compute_ns / 1e6
        path, model = _clipped(path), _clipped(model)
        request_id = None if record.request_id is None else _clipped(record.request_id)
        if self.format == "json":
            line = {
                "time": time.time(),
                "client": client,
                "method": method,
                "path": path,
                "model": model,
                "version": record.model_version,
                "status": status,
                "request_id": request_id,
                "duration_ms": round(duration_ms, 3),
                "queue_ms": round(queue_ms, 3),
                "compute_ms": round(compute_ms, 3),
            }
            logger.info(orjson.dumps(line).decode())
        else:
            logger.info(
                '%s "%s %s" %d %.2fms queue=%.2fms compute=%.2fms model=%s version=%s id=%s',
                _escaped(client), method, _escaped(path), status, duration_ms, queue_ms, compute_ms, _escaped(model),
                record.model_version, _escaped(request_id),
            )
