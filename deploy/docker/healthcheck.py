"""The image's HEALTHCHECK: exit 0 when /v2/health/live answers 200, else 1.

Reads the port from BATCHLINE_HTTP_PORT (default 8000) and the address from BATCHLINE_HOST; a
wildcard address (0.0.0.0, ::, empty) is checked on loopback. Standard library only: the slim
base has no curl.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def url() -> str:
    host = os.environ.get("BATCHLINE_HOST", "") or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = os.environ.get("BATCHLINE_HTTP_PORT", "") or "8000"
    return f"http://{host}:{port}/v2/health/live"


def main() -> int:
    try:
        with urllib.request.urlopen(url(), timeout=float(os.environ.get("BATCHLINE_HEALTHCHECK_TIMEOUT", "2"))) as r:
            return 0 if r.status == 200 else 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"healthcheck: {url()}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
