#!/bin/sh
# Run a command (a pip install) with the build's optional inputs, which are mounted for that one
# step and never copied into a layer:
#
#   with-build-inputs.sh DIR COMMAND [ARG...]
#
#   DIR/ca.crt   a CA bundle pip trusts instead of its own (a proxy that intercepts TLS): PIP_CERT
#   DIR/wheels/  a folder of wheels pip looks in besides its indexes (a local CPU torch wheel,
#                a company mirror's download): PIP_FIND_LINKS
#
# DIR empty or absent (a plain `docker build`): COMMAND runs as it is. scripts/image.sh fills DIR
# from the host's pip configuration (`pip config list`: cert, find-links) or its --ca-bundle and
# --wheels options, and passes it as the build context `build-inputs`.
set -eu
if [ "$#" -lt 2 ]; then
    echo "usage: $0 DIR COMMAND [ARG...]" >&2
    exit 2
fi
inputs=$1
shift
if [ -f "$inputs/ca.crt" ]; then
    PIP_CERT=$inputs/ca.crt
    export PIP_CERT
    echo "build inputs: pip trusts the CA bundle given to the build" >&2
fi
if [ -d "$inputs/wheels" ]; then
    PIP_FIND_LINKS=$inputs/wheels
    export PIP_FIND_LINKS
    echo "build inputs: pip also looks in the wheel folder given to the build ($(find "$inputs/wheels" -name '*.whl' | wc -l) wheels)" >&2
fi
exec "$@"
