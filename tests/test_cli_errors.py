"""`pdflow` as a careless user meets it: config errors are one line naming the key and
side (exit 1, no traceback), refusals exit 2 naming the job, help and version are pdflow's."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from pdflow import __version__
from pdflow.cli import main
from pdflow.spec.load import group_choices

PDFLOW = [sys.executable, "-m", "pdflow.cli"]


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """``pdflow`` in this process; Hydra's job logging (a handler on the stdout pytest
    captures, closed after the test) is taken off again, else every later test of this
    worker that logs writes "--- Logging error ---" tracebacks into its report."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    try:
        main(list(argv))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        root.handlers[:] = handlers
    out = capsys.readouterr()
    return code, out.out, out.err


CONFIG_ERRORS = [
    (("model.kv_heads=6",), ["model.kv_heads (6)", "multiple"]),
    (("decode.block_size=100", "decode.kv_page_tokens=16"),
     ["decode.kv_page_tokens (16) must divide decode.block_size (100)"]),
    (("prefill.tp=-1",), ["prefill.tp must be >= 1, got -1"]),
    (("decode.tp=0",), ["decode.tp must be >= 1"]),
    (("+foo=1",), ["foo is not a pdflow setting", "model, prefill, decode"]),
    (("foo=1",), ["foo is not a pdflow setting", "model, prefill, decode"]),
    (("+decode.foo=1",), ["decode.foo is not a pdflow setting", "block_size"]),
    (("decode.num_kv_blocks=-5",), ["decode.num_kv_blocks must be >= 1"]),
    (("decode.kv_dtype=fp7",), ["decode.kv_dtype 'fp7' is not a dtype", "bf16"]),
    (("model.layers=abc",), ["model.layers", "Integer"]),
    (("prefill=parallel_schema",), ["prefill=parallel_schema is not a prefill option", "pp4"]),
    (("prefill=nosuch",), ["prefill=nosuch is not a prefill option", "pp4"]),
    (("~model",), ["model has no value"]),
    (("--jsn",), ["unknown option --jsn"]),
]


@pytest.mark.parametrize("args, says", CONFIG_ERRORS, ids=[" ".join(a) for a, _ in CONFIG_ERRORS])
def test_config_error_is_one_line_naming_the_key(capsys, args, says):
    code, out, err = run_main(capsys, "plan", *args)
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdflow plan: "), err
    assert "_schema" not in lines[0].partition("choices:")[2] and "KV_POOL_EMPTY" not in err
    for words in says:
        assert words in lines[0], lines[0]
    assert out == ""


def test_config_error_from_the_installed_command_has_no_traceback(tmp_path):
    for args in (["model.kv_heads=6"], ["+foo=1"], ["decode.block_size=100", "decode.kv_page_tokens=16"]):
        run = subprocess.run([*PDFLOW, "plan", *args], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 1, run.stderr
        assert "Traceback" not in run.stderr and "HYDRA_FULL_ERROR" not in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_refusal_exits_2_with_reason_count_in_words(capsys):
    code, out, err = run_main(capsys, "plan", "prefill=pp4", "decode=tp4", "drafter=eagle3")
    assert code == 2
    assert "EAGLE3_UNDER_PP" in err and "(1 reason)" in err and "(1 reasons)" not in err


def test_sweep_names_the_refused_job(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # -m keeps Hydra's multirun/ folder in the cwd
    code, out, err = run_main(capsys, "plan", "-m", "prefill=pp4,tp4", "drafter=eagle3")
    assert code == 2
    assert "job #0 (prefill=pp4 drafter=eagle3)" in err and "EAGLE3_UNDER_PP" in err
    assert "prefill=tp4 drafter=eagle3" not in err  # the allowed job is not blamed
    assert (tmp_path / "multirun").is_dir()


def test_plan_help_is_pdflows(capsys):
    code, out, err = run_main(capsys, "plan", "--help")
    assert code == 0
    assert "powered by Hydra" not in out and "_schema" not in out
    for words in ("--json", "-m", "multirun/", "+experiment=", "exit codes", "0 ", "1 ", "2 "):
        assert words in out, words
    for group, options in group_choices().items():
        assert f"{group}:" in out and all(o in out for o in options)
    assert "tiny*" in out  # the default is marked


def test_version_and_unknown_command(capsys):
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.strip() == f"pdflow {__version__}"
    code, _, err = run_main(capsys, "plam")
    assert code == 1 and "unknown command 'plam'" in err
