#!/usr/bin/env bash
# The README's test command: install pdflow with its test extras, lint, run the suite.
# Without libibverbs1 the transfer tests skip, except under CI=true, where they fail.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
ruff check pdflow kernels tests scripts
# Two xdist workers (one per core of a small machine), each test module on one worker so
# its module-scoped deployments start once; PDFLOW_TEST_WORKERS=0 runs in one process.
workers="${PDFLOW_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then
  python -m pytest -q
else
  python -m pytest -q -n "$workers" --dist loadscope
fi
