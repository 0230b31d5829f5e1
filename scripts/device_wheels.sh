#!/usr/bin/env bash
# The wheels pdflow needs on a GPU machine that has torch, triton and transformers but no
# package registry (Python 3.12, x86-64), at the versions this venv runs, into .whl/.
# On that machine, from the repo root (kernels/ and conf/ install under pdflow.*, so a
# source tree needs the two links; only pdflow/ goes on the path, through /tmp/src: the
# repo root there would let kernels/ shadow the PyPI kernels that transformers >= 5.25 imports):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   mkdir -p /tmp/src && ln -sfn "$PWD/pdflow" /tmp/src/pdflow && export PYTHONPATH=/tmp/site:/tmp/src &&
#   ln -sfn ../kernels pdflow/kernels && ln -sfn ../conf pdflow/conf
set -euo pipefail
cd "$(dirname "$0")/.."
NAMES="hydra-core omegaconf msgspec pyzmq fastapi starlette pydantic pydantic_core typing-inspection
annotated-types annotated-doc opentelemetry-api importlib_metadata zipp uvicorn h11 httptools uvloop
httpx httpcore anyio sniffio idna certifi prometheus_client rich markdown-it-py mdurl pygments pytest
pluggy iniconfig packaging typing_extensions click"
PLATFORMS=""
for n in 1 5 17 24 26 27 28 31 34; do PLATFORMS+=" --platform manylinux_2_${n}_x86_64"; done
PLATFORMS+=" --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
mkdir -p .whl
for name in $NAMES; do
  version=$(python -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "not installed here: $name" >&2; exit 1; }
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS -d .whl "$name==$version"
done
# hydra's parser runtime ships as a source distribution only: build its (pure Python) wheel.
python -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3"
ls .whl | wc -l
