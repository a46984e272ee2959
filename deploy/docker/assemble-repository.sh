#!/bin/sh
# Copy what a server needs out of a source model repository: each model's config.yaml and its
# numbered version folders, nothing else (no build scripts, no eval data). Each version folder
# keeps its SHA256SUMS (the digests the server checks before loading), and each copy is checked
# against it here (sha256sum -c).
#
#   assemble-repository.sh SOURCE TARGET
#
# Fails if a model has no config.yaml or no built version, or if a copied version does not match
# its SHA256SUMS, so an image never ships a model that cannot load. A version without one is
# copied with a warning: the server loads it unverified, with the same warning.
set -eu
if [ "$#" -ne 2 ]; then
    echo "usage: $0 SOURCE TARGET" >&2
    exit 2
fi
source=$1
target=$2
count=0
for model in "$source"/*/; do
    name=$(basename "$model")
    if [ ! -f "$model/config.yaml" ]; then
        echo "assemble-repository: $model has no config.yaml" >&2
        exit 1
    fi
    mkdir -p "$target/$name"
    cp "$model/config.yaml" "$target/$name/config.yaml"
    versions=0
    for version in "$model"[0-9]*/; do
        [ -d "$version" ] || continue
        cp -R "$version" "$target/$name/"
        copied="$target/$name/$(basename "$version")"
        if [ -f "$copied/SHA256SUMS" ]; then
            if ! (cd "$copied" && sha256sum -c --quiet SHA256SUMS >&2); then
                echo "assemble-repository: $copied does not match its SHA256SUMS (damaged or half-built?)" >&2
                exit 1
            fi
        else
            echo "assemble-repository: warning: $name/$(basename "$version") has no SHA256SUMS; it loads unverified" >&2
        fi
        versions=$((versions + 1))
    done
    if [ "$versions" -eq 0 ]; then
        echo "assemble-repository: $name has no built version folder" >&2
        exit 1
    fi
    count=$((count + 1))
done
if [ "$count" -eq 0 ]; then
    echo "assemble-repository: no model in $source" >&2
    exit 1
fi
echo "assemble-repository: $count models into $target"
