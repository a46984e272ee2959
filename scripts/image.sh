#!/bin/bash
# Build Batchline's container image with whichever engine works here (docker, else podman).
#
#   scripts/image.sh build [--variant cpu|gpu] [--tag TAG] [--ca-bundle FILE] [--wheels DIR]...
#                          [--no-host-pip]
#   scripts/image.sh inputs DIR [the options above but --tag]
#                                fill DIR with the build inputs only, for a build by hand:
#                                docker build --build-context build-inputs=DIR ...
#   scripts/image.sh engine      print the engine's command line (e.g. "podman --runtime runc")
#   scripts/image.sh run-flags   print the flags `run` needs on this machine (ulimits), one a line
#
# Engine: $CONTAINER_ENGINE if set; else docker when `docker info` reaches a daemon; else podman
# when `podman info` works; else, as root with apt-get, podman (+ runc) is installed from the
# system's packages. Podman runs containers with runc where the cgroups are not cgroup v2 only
# (crun refuses hybrid cgroups), and with ulimits that fit this machine's (its defaults are refused
# where the host's hard limits are lower).
#
# Base image (cpu): $PYTHON_IMAGE (default python:3.11-slim-bookworm) when it is here or can be
# pulled; else one made here from Debian: debootstrap bookworm -> batchline-debian:bookworm ->
# deploy/docker/base.Dockerfile (Debian's python3 3.11 + venv) -> batchline-python:3.11-bookworm.
# Each is made once and reused. The gpu variant needs its CUDA_IMAGE (pulled, or already here).
#
# Build inputs: the CA bundle and the wheel folders of the host's pip configuration (`pip config
# list`: cert, find-links), or --ca-bundle / --wheels, reach the pip installs inside the build
# (deploy/docker/with-build-inputs.sh), never the image. A wheel folder that holds the variant's
# torch wheel (cpu: a +cpu build) makes the build take torch from there, not from PyTorch's index.
# --no-host-pip: take nothing from the host's pip configuration.
#
# The engine's layer cache makes a second build with unchanged sources take under a minute, and one
# after a change to the code a few minutes (the package layer and the models; the venv is kept).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm}
LOCAL_DEBIAN=batchline-debian:bookworm
LOCAL_PYTHON=batchline-python:3.11-bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

say() { echo "image: $*" >&2; }
die() { echo "image: $*" >&2; exit 1; }

# ---- the engine ------------------------------------------------------------------------------
ENGINE=()

cgroup_v2_only() { [ -f /sys/fs/cgroup/cgroup.controllers ]; }
can_install() { [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; }

install_podman() {
    [ "$(id -u)" -eq 0 ] || die "no usable docker or podman; install podman (and runc), or run as root to have it installed"
    command -v apt-get >/dev/null 2>&1 || die "no usable docker or podman, and no apt-get to install podman with"
    say "installing podman and runc from the system's packages (apt-get) ..."
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc uidmap slirp4netns fuse-overlayfs >/dev/null
}

find_engine() {
    if [ -n "${CONTAINER_ENGINE:-}" ]; then
        # shellcheck disable=SC2206  # "podman --runtime runc": one word per argument
        ENGINE=($CONTAINER_ENGINE)
        return
    fi
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        ENGINE=(docker)
        return
    fi
    if ! { command -v podman >/dev/null 2>&1 && podman info >/dev/null 2>&1; }; then
        install_podman
        podman info >/dev/null 2>&1 || die "podman was installed but 'podman info' fails: $(podman info 2>&1 | tail -1)"
    fi
    ENGINE=(podman)
    if ! cgroup_v2_only; then
        if ! command -v runc >/dev/null 2>&1; then
            can_install || die "these cgroups (v1 or hybrid) need podman's runc runtime; install runc"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runc >/dev/null
        fi
        ENGINE+=(--runtime runc)
    fi
}

is_podman() { [ "$(basename "${ENGINE[0]}")" = podman ]; }

# Podman's default nofile and nproc limits are refused where the host's hard limits are lower.
run_flags() {
    if is_podman; then
        local nofile
        nofile=$(ulimit -Hn)
        if [ "$nofile" = unlimited ] || [ "$nofile" -gt 1048576 ]; then nofile=1048576; fi
        echo "--ulimit"
        echo "nofile=$nofile:$nofile"
        echo "--ulimit"
        echo "nproc=4096:4096"
    fi
}

have_image() { "${ENGINE[@]}" image inspect "$1" >/dev/null 2>&1; }

# ---- the base image --------------------------------------------------------------------------
qualified() {  # podman does not search docker.io for short names unless configured to
    local name=$1 first=${1%%/*}
    if [ "$first" = "$name" ]; then
        echo "docker.io/library/$name"
    elif [[ "$first" != *.* && "$first" != *:* && "$first" != localhost ]]; then
        echo "docker.io/$name"
    else
        echo "$name"
    fi
}

pull() {
    local image=$1
    if is_podman; then image=$(qualified "$image"); fi
    say "pulling $image ..."
    timeout 600 "${ENGINE[@]}" pull "$image" >/dev/null 2>&1
}

make_debian_base() {
    command -v debootstrap >/dev/null 2>&1 || {
        can_install || die "no registry reachable and no debootstrap to make a base image with; install debootstrap, or pass PYTHON_IMAGE=an image that is here"
        say "installing debootstrap from the system's packages (apt-get) ..."
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    }
    [ "$(id -u)" -eq 0 ] || die "debootstrap needs root to make the base image"
    local rootfs
    rootfs=$(mktemp -d /tmp/batchline-rootfs.XXXXXX)
    # shellcheck disable=SC2064  # the folder is known now
    trap "rm -rf '$rootfs'" EXIT
    say "no registry reachable: making a Debian bookworm base with debootstrap (about a minute) ..."
    if ! debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >"$rootfs.log" 2>&1; then
        tail -5 "$rootfs.log" >&2
        rm -f "$rootfs.log"
        die "debootstrap failed (log above)"
    fi
    rm -f "$rootfs.log"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | "${ENGINE[@]}" import - "$LOCAL_DEBIAN" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
}

# Prints the base image to build on.
python_base() {
    if have_image "$PYTHON_IMAGE" || pull "$PYTHON_IMAGE"; then
        echo "$PYTHON_IMAGE"
        return
    fi
    say "$PYTHON_IMAGE cannot be pulled; using $LOCAL_PYTHON (Debian's python3), made here once"
    if ! have_image "$LOCAL_PYTHON"; then
        local debian=$LOCAL_DEBIAN
        if ! have_image "$LOCAL_DEBIAN"; then
            if pull debian:bookworm-slim; then debian=debian:bookworm-slim; else make_debian_base; fi
        fi
        local flags=()
        if is_podman; then mapfile -t flags < <(run_flags); flags+=(--format docker); fi
        "${ENGINE[@]}" build "${flags[@]}" --build-arg "DEBIAN_IMAGE=$debian" -t "$LOCAL_PYTHON" \
            -f "$ROOT/deploy/docker/base.Dockerfile" "$ROOT/deploy/docker" >&2
    fi
    echo "$LOCAL_PYTHON"
}

# ---- build inputs ----------------------------------------------------------------------------
CA_BUNDLE=""
WHEEL_DIRS=()
HOST_PIP=1

host_pip_config() {  # key=value lines of `pip config list`, or nothing
    local pip=()
    if [ -x "$ROOT/.venv/bin/python" ]; then pip=("$ROOT/.venv/bin/python" -m pip)
    elif command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then pip=(python3 -m pip)
    else return 0
    fi
    "${pip[@]}" config list 2>/dev/null || true
}

from_host_pip() {
    local config line value dir
    config=$(host_pip_config)
    if [ -z "$CA_BUNDLE" ]; then
        line=$(grep -E '^[^=]*\bcert=' <<<"$config" | head -1 || true)
        value=${line#*=}; value=${value//\'/}
        if [ -n "$value" ] && [ -f "$value" ]; then CA_BUNDLE=$value; fi
    fi
    while IFS= read -r line; do
        value=${line#*=}; value=${value//\'/}
        for dir in $value; do
            dir=${dir#file://}
            if [ -d "$dir" ]; then WHEEL_DIRS+=("$dir"); fi
        done
    done < <(grep -E '^[^=]*\bfind-links=' <<<"$config" || true)
}

# Fills DIR with ca.crt and wheels/ (hard links where it can); prints "torch" when the wheels
# hold the variant's torch.
gather_inputs() {
    local dir=$1 variant=$2 wheel name folder seen=" "
    if [ -n "$CA_BUNDLE" ]; then
        cp "$CA_BUNDLE" "$dir/ca.crt"
        say "build input: CA bundle $CA_BUNDLE"
    fi
    [ "${#WHEEL_DIRS[@]}" -gt 0 ] || return 0
    mkdir -p "$dir/wheels"
    for folder in "${WHEEL_DIRS[@]}"; do
        case "$seen" in *" $folder "*) continue ;; esac
        seen="$seen$folder "
        for wheel in "$folder"/*.whl; do
            [ -f "$wheel" ] || continue
            name=$(basename "$wheel")
            # The other variant's torch never reaches a build: a +cpu wheel sorts above PyPI's
            # CUDA build of the same version, a +cuXXX one would put CUDA into the CPU image.
            case "$variant:$name" in
                cpu:torch-*+cu*|gpu:torch-*+cpu*) continue ;;
            esac
            ln "$wheel" "$dir/wheels/$name" 2>/dev/null || cp "$wheel" "$dir/wheels/$name"
        done
        say "build input: wheels from $folder"
    done
    case "$variant" in
        cpu) compgen -G "$dir/wheels/torch-*+cpu-*.whl" >/dev/null && echo torch ;;
        gpu) compgen -G "$dir/wheels/torch-*+cu*-*.whl" >/dev/null && echo torch ;;
    esac
    return 0
}

# ---- build -----------------------------------------------------------------------------------
version() { sed -n 's/^version *= *"\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1; }

VARIANT=cpu
TAG=""

parse_options() {
    local folder
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --variant) VARIANT=$2; shift 2 ;;
            --tag) TAG=$2; shift 2 ;;
            --ca-bundle) CA_BUNDLE=$2; shift 2 ;;
            --wheels) WHEEL_DIRS+=("$2"); shift 2 ;;
            --no-host-pip) HOST_PIP=0; shift ;;
            *) die "unknown option $1 (see the top of $0)" ;;
        esac
    done
    case "$VARIANT" in cpu|gpu) ;; *) die "--variant is cpu or gpu, not '$VARIANT'" ;; esac
    [ -z "$CA_BUNDLE" ] || [ -f "$CA_BUNDLE" ] || die "--ca-bundle $CA_BUNDLE: no such file"
    for folder in "${WHEEL_DIRS[@]}"; do [ -d "$folder" ] || die "--wheels $folder: no such folder"; done
    if [ "$HOST_PIP" -eq 1 ]; then from_host_pip; fi
}

# `inputs DIR`: the build inputs alone, for a build by hand (--build-context build-inputs=DIR).
inputs_only() {
    [ "$#" -ge 1 ] || die "usage: $0 inputs DIR [--variant cpu|gpu] [--ca-bundle FILE] [--wheels DIR]... [--no-host-pip]"
    local dir=$1
    shift
    parse_options "$@"
    mkdir -p "$dir"
    if [ -n "$(gather_inputs "$dir" "$VARIANT")" ]; then
        say "the $VARIANT torch wheel is in $dir/wheels: build with --build-arg TORCH_INDEX_URL= to take it from there"
    fi
}

build() {
    parse_options "$@"
    local variant=$VARIANT tag=$TAG
    [ -n "$tag" ] || tag="batchline:$(version)-$variant"

    find_engine
    say "engine: ${ENGINE[*]}"
    local started args=(--build-arg "VARIANT=$variant")
    started=$(date +%s)
    if [ "$variant" = cpu ]; then
        local base
        base=$(python_base)
        args+=(--build-arg "PYTHON_IMAGE=$base")
    else
        local cuda
        cuda=$(sed -n 's/^ARG CUDA_IMAGE=//p' "$ROOT/Dockerfile")
        cuda=${CUDA_IMAGE:-$cuda}
        have_image "$cuda" || pull "$cuda" \
            || die "the GPU image's base $cuda is not here and cannot be pulled (no registry reachable?); pull or load it first, or pass CUDA_IMAGE=an nvidia/cuda runtime image of CUDA 13 that is here"
        args+=(--build-arg "CUDA_IMAGE=$cuda")
    fi

    local inputs
    inputs=$(mktemp -d /tmp/batchline-build-inputs.XXXXXX)
    # shellcheck disable=SC2064
    trap "rm -rf '$inputs'" EXIT
    if [ -n "$(gather_inputs "$inputs" "$variant")" ]; then
        say "build input: the $variant torch wheel comes from the wheel folder, not PyTorch's index"
        args+=(--build-arg "TORCH_INDEX_URL=")
    fi
    if [ -n "$(ls -A "$inputs")" ]; then args+=(--build-context "build-inputs=$inputs"); fi
    if is_podman; then
        local flags
        mapfile -t flags < <(run_flags)
        # docker format: OCI images drop HEALTHCHECK. The layer cache is podman's default (--layers).
        args+=(--format docker --layers "${flags[@]}")
    fi
    say "building $tag ..."
    if [ "${ENGINE[0]}" = docker ]; then export DOCKER_BUILDKIT=1; fi
    "${ENGINE[@]}" build "${args[@]}" -t "$tag" -f "$ROOT/Dockerfile" "$ROOT"
    rm -rf "$inputs"
    trap - EXIT
    local size
    size=$("${ENGINE[@]}" image inspect --format '{{.Size}}' "$tag")
    say "built $tag in $(( $(date +%s) - started )) s; size $(( size / 1000000 )) MB"
}

main() {
    case "${1:-}" in
        build) shift; build "$@" ;;
        inputs) shift; inputs_only "$@" ;;
        engine) find_engine; echo "${ENGINE[*]}" ;;
        run-flags) find_engine; run_flags ;;
        *) echo "usage: $0 build [--variant cpu|gpu] [--tag TAG] [--ca-bundle FILE] [--wheels DIR]... [--no-host-pip]" >&2
           echo "       $0 inputs DIR [the same options but --tag] | engine | run-flags" >&2
           exit 2 ;;
    esac
}

# On one line: bash has read it whole before it runs, so editing this file during a build is safe.
main "$@"; exit "$?"
