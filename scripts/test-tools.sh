#!/bin/sh
# The system tools `make test` drives, from Debian's packages: wrk (load-test runs), h2load
# (nghttp2-client: gRPC load in `bench frontends`) and prometheus (promtool, and a real
# Prometheus scraping the server). Installs what is missing, or says in one line why it cannot
# and exits non-zero, so the tests never start without them.
set -eu
missing=""
command -v wrk >/dev/null 2>&1 || missing="$missing wrk"
command -v promtool >/dev/null 2>&1 || missing="$missing prometheus"
command -v h2load >/dev/null 2>&1 || missing="$missing nghttp2-client"
[ -z "$missing" ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "make test needs:$missing; run as root, or install them first: sudo apt-get install -y$missing" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "make test needs:$missing; there is no apt-get here: install them with your system's packages" >&2
    exit 1
fi
echo "installing$missing from the system's packages (apt-get) ..." >&2
apt-get update -qq
# shellcheck disable=SC2086  # one word per package
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
for tool in wrk promtool prometheus h2load; do
    command -v "$tool" >/dev/null 2>&1 || { echo "$tool is still missing after apt-get install" >&2; exit 1; }
done
