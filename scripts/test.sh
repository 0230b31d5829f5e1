#!/usr/bin/env bash
# The README's test command: install pdflow with its test extras, lint, run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU Mooncake wheel loads libibverbs.so.1 (Debian's libibverbs1); install it if it
# is missing and this user may (root, as CI runs). Without it the transfer tests skip,
# except under CI=true, where they fail.
if ! ldconfig -p | grep -q "libibverbs.so.1 " && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
fi
python -m pip install -q torch==2.13.0 -e ".[test]"
ruff check pdflow kernels tests scripts
python -m pytest -q
