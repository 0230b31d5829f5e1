"""The README's engine example runs as users first run it: saved as a script without an
``if __name__ == "__main__":`` guard, and piped to ``python -``. Rank processes are their
own entry point, so neither depends on re-importing the user's main module (with
multiprocessing's spawn, both died at start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    """The README's first Python block, as written there, with fewer tokens and a line
    the test can find."""
    block = README.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    assert "max_tokens=64" in block, "the README example changed: update this test"
    block = block.replace("max_tokens=64", "max_tokens=6")
    return block + 'print("GENERATED", len(out[0].token_ids), repr(out[0].text))\n'


EXAMPLE = readme_example()


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
