"""The access log moved to `server.access_log` (it covers every front end); kept importable here."""

from server.access_log import AccessLog, AccessLogFormat

__all__ = ["AccessLog", "AccessLogFormat"]
