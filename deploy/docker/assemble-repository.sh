#!/bin/sh
# Copy what a server needs out of a source model repository: each model's config.yaml and its
# numbered version folders, nothing else (no build scripts, no eval data).
#
#   assemble-repository.sh SOURCE TARGET
#
# Fails if a model has no config.yaml or no built version, so an image never ships a model that
# cannot load.
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
