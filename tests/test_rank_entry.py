"""The README's engine example runs as users first run it: saved as a script without an
``if __name__ == "__main__":`` guard, and piped to ``python -``. Rank processes are their
own entry point, so neither depends on re-importing the user's main module (with
multiprocessing's spawn, both died at start)."""

from __future__ import annotations

import subprocess
import sys

import pytest

EXAMPLE = """
from pdflow import LLM, SamplingParams
from pdflow.spec import ParallelSpec

with LLM("pdflow:assets/tiny", ParallelSpec(tp=2, block_size=128, kv_page_tokens=16)) as llm:
    out = llm.generate(["Question: Mira has 12 apples. Mira buys 7 more apples. How many apples "
                        "does Mira have now?\\nAnswer:"], SamplingParams(temperature=0, max_tokens=6))
    print("GENERATED", len(out[0].token_ids), repr(out[0].text))
"""


def _check(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0, run.stdout + run.stderr
    assert "GENERATED 6 " in run.stdout, run.stdout + run.stderr


@pytest.mark.slow
def test_example_runs_as_a_script_without_a_main_guard(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(EXAMPLE)
    _check(subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600))


@pytest.mark.slow
def test_example_runs_piped_to_python_stdin(tmp_path):
    _check(subprocess.run([sys.executable, "-"], input=EXAMPLE, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600))
