"""lm-eval 0.4.x ``local-completions`` scores a loglikelihood multiple-choice task (the
shipped model's arithmetic, ``pdflow/bench/tasks/lm_eval``) through ``pdflow serve`` (the
default P/D deployment: its prompt logprobs are computed by the prefill instance), and
its accuracy equals the same scoring done offline with one process's prompt logprobs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdflow import LLM, SamplingParams

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "pdflow" / "bench" / "tasks" / "lm_eval"
ASSET = ROOT / "pdflow" / "assets" / "tiny"
URL = re.compile(r" at (http://127\.0\.0\.1:\d+)/v1")
# The task's first docs (lm-eval's ``limit``): each is 4 prompts of ~500 tokens, scored
# twice (served, offline); the per-choice logprobs compared below are the oracle.
DOCS = 8


def _serve(tmp_path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MC_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "pdflow.cli", "serve", "serve.port=0", "tracking=off"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=tmp_path, start_new_session=True)
    deadline, seen = time.monotonic() + 300, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if found := URL.search(line):
            return proc, found.group(1)
    _stop(proc)
    raise AssertionError("no URL from pdflow serve:\n" + "".join(seen[-40:]))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _offline(docs: list[dict]) -> tuple[float, list[list[float]]]:
    """lm-eval's scoring with the engine's prompt logprobs: each choice's continuation
    tokens (lm-eval's split: the whole text encoded, the context's tokens cut off), summed;
    a doc is right when its label's sum is the largest."""
    with LLM("pdflow:assets/tiny") as llm:
        tok = llm.tokenizer
        pairs = [(tok.encode(d["context"]), tok.encode(d["context"] + c)) for d in docs for c in d["choices"]]
        outs = llm.generate([whole for _, whole in pairs],
                            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    sums = [sum(o.prompt_logprobs[len(ctx) - 1:]) for (ctx, _), o in zip(pairs, outs, strict=True)]
    per_doc, right, at = [], 0, 0
    for d in docs:
        scores = sums[at:at + len(d["choices"])]
        at += len(d["choices"])
        per_doc.append(scores)
        right += max(range(len(scores)), key=scores.__getitem__) == d["label"]
    return right / len(docs), per_doc


def test_lm_eval_loglikelihood_task_through_pdflow_serve_equals_offline(tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(ROOT)  # the task's data file is named relative to the repository root
    docs = [json.loads(line) for line in (TASKS / "arith_mc.jsonl").read_text().splitlines()][:DOCS]
    proc, url = _serve(tmp_path)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(f"model=tiny,base_url={url}/v1/completions,tokenizer={ASSET},tokenizer_backend=huggingface,"
                        "add_bos_token=True,num_concurrent=4,max_retries=1,tokenized_requests=True"),
            tasks=["pdflow_arith_mc"], task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
            log_samples=True,
            limit=DOCS,
        )
    finally:
        _stop(proc)
    served_acc = results["results"]["pdflow_arith_mc"]["acc,none"]
    offline_acc, offline = _offline(docs)
    assert served_acc == offline_acc
    assert served_acc > 1 / 4  # above chance: the logprobs are the model's, not noise
    assert len(results["samples"]["pdflow_arith_mc"]) == DOCS
    for sample in results["samples"]["pdflow_arith_mc"]:
        served = [r[0][0] for r in sample["resps"]]
        assert served == pytest.approx(offline[sample["doc_id"]], abs=1e-3)
