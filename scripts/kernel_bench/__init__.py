"""The kernel benchmark harness: checks, timings, the tuning sweep, the experimental
prefill variants and the sm_90 compile check behind scripts/bench_kernels.py.

Not installed: scripts/bench_kernels.py and the kernel tests (tests/conftest.py) put
scripts/ on sys.path. The kernels are imported as ``pdflow.kernels`` everywhere. A GPU
image without pdflow installed still runs the bench: the repository's kernels/ folder is
then mapped to ``pdflow.kernels`` here, as setuptools' package-dir does on install
(``import pdflow`` itself is torch- and hydra-free).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_kernels_from_checkout() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    pdflow = importlib.import_module("pdflow")
    init = ROOT / "kernels" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "pdflow.kernels", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["pdflow.kernels"] = module
    spec.loader.exec_module(module)
    pdflow.kernels = module


try:
    importlib.import_module("pdflow.kernels")
except ImportError:
    _import_kernels_from_checkout()
