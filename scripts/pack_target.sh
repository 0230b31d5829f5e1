#!/usr/bin/env bash
# Pack a checkpoint dir into <12 MB tar pieces + a checksum, for a size-capped transfer.
#   bash scripts/pack_target.sh CKPT_DIR OUT_DIR   -> OUT_DIR/tiny.tar.part-00.. + tiny.tar.sha256
set -euo pipefail
ckpt=${1:?checkpoint dir}
out=${2:?output dir}
mkdir -p "$out"
tmp=$(mktemp)
# Flat list of the checkpoint's files (no "./" entry), stable order.
(cd "$ckpt" && find . -maxdepth 1 -type f -printf '%f\n' | LC_ALL=C sort) > "$tmp.list"
tar -C "$ckpt" -cf "$tmp" -T "$tmp.list"
(cd "$(dirname "$tmp")" && sha256sum "$(basename "$tmp")") | awk '{print $1}' > "$out/tiny.tar.sha256"
split -b 11000000 -d -a 2 "$tmp" "$out/tiny.tar.part-"
rm -f "$tmp" "$tmp.list"
ls -l "$out"
