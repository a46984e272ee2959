# A Python 3.11 base from Debian's own packages, for the CPU image where python:3.11-slim-bookworm
# cannot be pulled (no registry reachable). scripts/image.sh makes it when it has to:
#
#   debootstrap --variant=minbase bookworm ROOTFS  ->  import as batchline-debian:bookworm
#   build this file with DEBIAN_IMAGE=batchline-debian:bookworm  ->  batchline-python:3.11-bookworm
#   build the Dockerfile with PYTHON_IMAGE=batchline-python:3.11-bookworm
#
# Where a registry is reachable, the default DEBIAN_IMAGE (debian:bookworm-slim) gives the same
# base. Debian's python3 is 3.11 on bookworm; python3-venv makes the image's /opt/venv.
ARG DEBIAN_IMAGE=debian:bookworm-slim
FROM ${DEBIAN_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -c 'import sys, venv; assert sys.version_info[:2] == (3, 11), sys.version'
