#!/usr/bin/env bash
# The README's test command: install pdflow with its test extras, lint, run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0 -e ".[test]"
ruff check pdflow kernels tests scripts
python -m pytest -q -x
