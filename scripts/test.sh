#!/usr/bin/env bash
# The README's test command: install pdflow with its test extras, lint, run the suite.
# Without libibverbs1 the transfer tests skip, except under CI=true, where they fail.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
ruff check pdflow kernels tests scripts
python -m pytest -q
