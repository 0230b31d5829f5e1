#!/usr/bin/env bash
# Install pdflow for a CPU machine (the README's first command runs this, then `pdflow run`).
#   bash scripts/install.sh           pdflow + the CPU Mooncake Transfer Engine
#   bash scripts/install.sh test      ... and the test extras (what scripts/test.sh uses)
# The CPU Mooncake wheel loads libibverbs.so.1 (Debian's libibverbs1, even for TCP); it is
# installed with apt-get when missing and this user may (root, or passwordless sudo).
# torch is pinned so pip takes the CPU wheel instead of a multi-GB CUDA build; on a GPU
# machine install the `transfer-cuda` extra instead of `transfer-cpu` (never both).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ldconfig -p | grep -q "libibverbs.so.1 " && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
  elif sudo -n true 2>/dev/null; then
    sudo apt-get update -qq && sudo apt-get install -y -qq libibverbs1 >/dev/null
  else
    echo "install.sh: libibverbs1 is missing and apt-get needs root: sudo apt-get install libibverbs1" >&2
  fi
fi
extras="transfer-cpu"
[ "${1:-}" = test ] && extras="test"
python -m pip install -q torch==2.13.0 -e ".[$extras]"
