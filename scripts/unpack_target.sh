#!/usr/bin/env bash
# Restore a checkpoint packed by pack_target.sh (checksum verified) into DEST.
#   bash scripts/unpack_target.sh FILES_DIR [DEST=pdflow/assets/tiny]
# Files already in DEST that the tar does not hold (the model card README.md) are kept.
set -euo pipefail
src=${1:?dir holding tiny.tar.part-* and tiny.tar.sha256}
dest=${2:-pdflow/assets/tiny}
tmp=$(mktemp)
cat "$src"/tiny.tar.part-* > "$tmp"
want=$(cat "$src/tiny.tar.sha256")
got=$(sha256sum "$tmp" | awk '{print $1}')
if [ "$want" != "$got" ]; then
  echo "checksum mismatch: want $want got $got" >&2
  rm -f "$tmp"
  exit 1
fi
mkdir -p "$dest"
tar -tf "$tmp" | sed "s|^|$dest/|"
tar -C "$dest" --no-same-owner -xf "$tmp"
rm -f "$tmp"
