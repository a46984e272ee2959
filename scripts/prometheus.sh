#!/usr/bin/env bash
# A real Prometheus on loopback that scrapes a Batchline server and evaluates
# deploy/prometheus/rules.yml: for looking at the metrics while load-testing, and for the
# end-to-end tests (tests/deploy/test_prometheus_e2e.py). Debian's `prometheus` package does not
# need to run as a service: this starts the binary itself, in the background, with a config in a
# folder of its own, and stops it by the PID it wrote.
#
#   scripts/prometheus.sh start [--target HOST:PORT]... [--port N] [--interval 1s] [--label K=V]... [--dir DIR]
#   scripts/prometheus.sh stop [--dir DIR]
#   scripts/prometheus.sh status [--dir DIR]
#
# start   writes DIR/prometheus.yml (job "batchline" scraping each --target every --interval,
#         with the target labels given; rules.yml evaluated at the same interval), starts
#         Prometheus on 127.0.0.1:PORT with its data in DIR/data, waits until it is ready and
#         prints its URL. Fails if one already runs from DIR.
# stop    sends SIGTERM to the PID in DIR/prometheus.pid (only if that PID is a prometheus),
#         waits up to 15 s, then SIGKILL; removes the PID file. Succeeds if none runs.
# status  prints the URL and exits 0 if it runs, exits 1 if not.
#
# Defaults: --target 127.0.0.1:8000, --port 9090 (0: a free port), --interval 1s,
# --dir ${TMPDIR:-/tmp}/batchline-prometheus, and the labels namespace=batchline, pod=local, as a
# Kubernetes ServiceMonitor would add them, so that the HPA/KEDA queries of deploy/k8s run
# unchanged (a --label replaces these defaults). PROMETHEUS: the binary (default: prometheus on
# PATH; Debian/Ubuntu: apt-get install -y prometheus).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rules="$root/deploy/prometheus/rules.yml"
prometheus=${PROMETHEUS:-prometheus}

usage() {
    sed -n '8,10p' "${BASH_SOURCE[0]}" | sed 's/^# *//' >&2
    exit 2
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

ready() {  # ready URL: exit 0 once /-/ready answers 200
    python3 - "$1" <<'EOF'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1] + "/-/ready", timeout=1) as r:
        sys.exit(0 if r.status == 200 else 1)
except OSError:
    sys.exit(1)
EOF
}

port_free() {  # port_free PORT: exit 0 if nothing listens on 127.0.0.1:PORT
    python3 - "$1" <<'EOF'
import socket, sys
with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", int(sys.argv[1])))
    except OSError:
        sys.exit(1)
EOF
}

is_prometheus() {  # is_prometheus PID
    [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -q prometheus
}

[ "$#" -ge 1 ] || usage
command=$1
shift
dir=${TMPDIR:-/tmp}/batchline-prometheus
port=9090
interval=1s
targets=()
labels=()
while [ "$#" -gt 0 ]; do
    case "$1" in
        --target) targets+=("$2"); shift 2 ;;
        --port) port=$2; shift 2 ;;
        --interval) interval=$2; shift 2 ;;
        --label) labels+=("$2"); shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        *) echo "prometheus.sh: unknown argument $1" >&2; usage ;;
    esac
done
pidfile="$dir/prometheus.pid"
urlfile="$dir/prometheus.url"

running_pid() {  # prints the PID and exits 0 if the one in the PID file runs
    [ -f "$pidfile" ] || return 1
    local pid
    pid=$(cat "$pidfile")
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && is_prometheus "$pid" && echo "$pid"
}

case "$command" in
    start)
        if ! command -v "$prometheus" >/dev/null 2>&1; then
            echo "prometheus.sh: '$prometheus' not found; install it: apt-get install -y prometheus" >&2
            exit 3
        fi
        if pid=$(running_pid); then
            echo "prometheus.sh: already running from $dir (pid $pid): $(cat "$urlfile")" >&2
            exit 1
        fi
        [ "${#targets[@]}" -gt 0 ] || targets=(127.0.0.1:8000)
        [ "${#labels[@]}" -gt 0 ] || labels=(namespace=batchline pod=local)
        mkdir -p "$dir/data"
        {
            echo "# written by scripts/prometheus.sh"
            echo "global:"
            echo "  scrape_interval: $interval"
            echo "  scrape_timeout: $interval"
            echo "  evaluation_interval: $interval"
            echo "rule_files: ['$rules']"
            echo "scrape_configs:"
            echo "  - job_name: batchline"
            echo "    static_configs:"
            echo "      - targets: [$(printf "'%s'," "${targets[@]}" | sed 's/,$//')]"
            echo "        labels:"
            for label in "${labels[@]}"; do
                echo "          ${label%%=*}: '${label#*=}'"
            done
        } > "$dir/prometheus.yml"
        # --port 0: a free port is picked, then bound by Prometheus a moment later; another process
        # may take it in between, so a clash is retried on a new port (Prometheus cannot report one).
        any_port=0
        [ "$port" != 0 ] || any_port=1
        for attempt in 1 2 3 4 5; do
            [ "$any_port" = 0 ] || port=$(free_port)
            if ! port_free "$port"; then
                [ "$any_port" = 1 ] && continue
                echo "prometheus.sh: port $port on 127.0.0.1 is in use; choose another with --port (0: any free one)" >&2
                exit 1
            fi
            url="http://127.0.0.1:$port"
            nohup "$prometheus" \
                --config.file="$dir/prometheus.yml" \
                --storage.tsdb.path="$dir/data" \
                --web.listen-address="127.0.0.1:$port" \
                --web.enable-lifecycle \
                --log.level=warn \
                > "$dir/prometheus.log" 2>&1 < /dev/null &
            pid=$!
            echo "$pid" > "$pidfile"
            echo "$url" > "$urlfile"
            for _ in $(seq 150); do
                if ready "$url" && kill -0 "$pid" 2>/dev/null; then
                    echo "$url"
                    exit 0
                fi
                if ! kill -0 "$pid" 2>/dev/null; then
                    rm -f "$pidfile"
                    if [ "$any_port" = 1 ] && [ "$attempt" -lt 5 ] && grep -q "address already in use" "$dir/prometheus.log"; then
                        continue 2  # the port was taken in between: another one
                    fi
                    echo "prometheus.sh: prometheus exited; its log ($dir/prometheus.log):" >&2
                    cat "$dir/prometheus.log" >&2
                    exit 1
                fi
                sleep 0.2
            done
            break
        done
        echo "prometheus.sh: not ready on $url after 30 s; stopping it. Log:" >&2
        cat "$dir/prometheus.log" >&2
        kill "$pid" 2>/dev/null || true
        rm -f "$pidfile"
        exit 1
        ;;
    stop)
        if ! pid=$(running_pid); then
            rm -f "$pidfile"
            exit 0
        fi
        kill -TERM "$pid"
        for _ in $(seq 75); do
            kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; exit 0; }
            sleep 0.2
        done
        echo "prometheus.sh: pid $pid ignored SIGTERM for 15 s; killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$pidfile"
        ;;
    status)
        if running_pid >/dev/null; then
            cat "$urlfile"
        else
            echo "prometheus.sh: not running from $dir" >&2
            exit 1
        fi
        ;;
    *)
        usage
        ;;
esac
