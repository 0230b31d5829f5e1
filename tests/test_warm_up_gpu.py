"""On a GPU, the start-up warm-up compiles every Triton specialization a served mix of
requests meets: with an empty Triton cache, no kernel is added to it after the
deployment is ready. Run by the lead: ``pytest -m gpu tests/test_warm_up_gpu.py``.

Counted in a fresh interpreter whose ``TRITON_CACHE_DIR`` is an empty folder: every
compiled specialization is a folder there, so one compiled inside a request shows up as
a new folder (named in the failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

ONE_GPU = ["prefill=tp1", "decode=tp1", "drafter=none", "prefill.device=cuda", "decode.device=cuda",
           "decode.device_offset=0", "transfer=nccl", "tracking=off"]
MONOLITHIC_DSPARK = ["mode=monolithic", "decode=tp1", "decode.device=cuda", "drafter=dspark", "tracking=off"]
# bf16 at head dim 64 (a random two-layer Qwen3-0.6B shape) with 16,384 tokens a step: the warm-up's own prefills (512 tokens at
# most) stay below the Gluon kernel's three-warpgroup break (4,096), and the mix adds a
# 5,000-token prompt past it.
D64_LARGE_BUDGET = ["mode=monolithic", "decode=tp1", "decode.device=cuda", "drafter=none", "tracking=off",
                    "model=qwen3-0.6b", "model.path=null", "model.head_dim=64", "model.layers=2",
                    "model.max_model_len=16384", "decode.max_num_batched_tokens=16384"]

SERVE_A_MIX = textwrap.dedent("""
    import json, os, pathlib, sys
    from pdflow import Deployment, SamplingParams, compose

    cache = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
    def kernels():
        return {p.name: sorted(q.name for q in p.iterdir()) for p in cache.iterdir()} if cache.exists() else {}

    with Deployment(compose(json.loads(sys.argv[1]))) as d:
        ready = kernels()
        vocab = d.vocab_size
        lengths = [1, 5, 37, 130, 300, 700, 16, 64] + json.loads(sys.argv[2])
        prompts = [[3 + (7 * i + n) % (vocab - 3) for i in range(n)] for n in lengths]
        greedy = SamplingParams(temperature=0, max_tokens=40)
        d.generate(prompts, greedy)  # all at once: mixed prefill and decode steps
        for p in prompts[:3]:
            d.generate([p], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=1))
        d.generate([prompts[5] + prompts[2]], greedy)  # a prefix-cache hit and its tail
        after = kernels()

    def what(folder):  # the kernel's constexprs and integer classes: which shape class was missed
        for f in (cache / folder).glob("*.json"):
            if not f.name.startswith("__grp__"):
                meta = json.loads(f.read_text())
                return {k: meta.get(k) for k in ("name", "constants", "attrs", "num_warps") if k in meta}
        return sorted(p.name for p in (cache / folder).iterdir())
    print(json.dumps({"ready": ready, "new": {k: what(k) for k in after if k not in ready}}))
""")


@pytest.mark.parametrize(("overrides", "more_lengths"), [(ONE_GPU, []), (MONOLITHIC_DSPARK, []),
                                                          (D64_LARGE_BUDGET, [5000])],
                         ids=["one-gpu-pd", "monolithic-dspark", "d64-16k-budget"])
def test_no_kernel_compiles_after_ready(tmp_path, overrides, more_lengths):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run([sys.executable, "-c", SERVE_A_MIX, json.dumps(overrides), json.dumps(more_lengths)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ready"], "the warm-up compiled nothing into the empty cache"
    assert result["new"] == {}, f"compiled inside requests: {result['new']}"
