"""The model's fused-kernel switch: off by default on CPU (the oracle path), and when forced
on (kernels under TRITON_INTERPRET) the same greedy tokens as the torch ops, with the
kernels really running and the KV write done by the RoPE kernel instead of the backend."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton kernel decoration
    os.environ["TRITON_INTERPRET"] = "1"

from pdflow import LLM, SamplingParams  # noqa: E402
from pdflow.attention.torch_backend import TorchBackend  # noqa: E402
from pdflow.model import fused  # noqa: E402
from pdflow.model.hf_checkpoint import write_random_checkpoint  # noqa: E402
from pdflow.spec import ParallelSpec  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
REAL_OPS, REAL_STORE_KV = fused.ops, TorchBackend.store_kv  # before any run wraps them


@pytest.mark.parametrize("raw,want", [("on", True), ("1", True), ("off", False), ("0", False),
                                      ("auto", None), (" AUTO ", None)])
def test_setting_from_env(monkeypatch, raw, want):
    monkeypatch.setenv(fused.ENV, raw)
    assert fused.setting_from_env() is want


def test_setting_from_env_refuses_unknown_values(monkeypatch):
    monkeypatch.setenv(fused.ENV, "yes please")
    with pytest.raises(ValueError, match="use on, off or auto"):
        fused.setting_from_env()


def test_auto_is_off_for_cpu_tensors_and_other_backends():
    class Triton:  # only the name matters to the switch
        name = "triton"

    cpu = torch.zeros(1)
    assert not fused.enabled(None, cpu, Triton())
    assert not fused.enabled(None, cpu, TorchBackend())
    assert fused.enabled(True, cpu, TorchBackend())
    assert not fused.enabled(False, cpu, Triton())


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    """Small random checkpoints: Llama (q and k rotated together) and Qwen3 (qk-norm)."""
    folder = tmp_path_factory.mktemp(request.param)
    return write_random_checkpoint(folder, family=request.param, layers=2, hidden=64, heads=4,
                                   kv_heads=2, head_dim=16, intermediate=96, vocab=160,
                                   init_std=0.3, seed=3, tokenizer=False)


def _run(folder, monkeypatch, setting: str):
    """Greedy outputs with the fused kernels on/off; also counts each kernel's calls and
    the backend's own KV writes."""
    monkeypatch.setenv(fused.ENV, setting)
    counts = {"rms_norm": 0, "silu_and_mul": 0, "qk_rope_": 0, "store_kv": 0}
    real = REAL_OPS()

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(fused, "ops", lambda: fused.FusedOps(
        **{n: counted(n, getattr(real, n)) for n in ("rms_norm", "silu_and_mul", "qk_rope_")}))
    monkeypatch.setattr(TorchBackend, "store_kv", counted("store_kv", REAL_STORE_KV))
    spec = ParallelSpec(block_size=32, kv_page_tokens=16, num_kv_blocks=16,
                        max_num_batched_tokens=24, enable_prefix_caching=False)
    llm = LLM(str(folder), spec, dtype="float32")
    assert llm.instance.executor.stage.model.fused_kernels is {"on": True, "off": False}[setting]
    gen = torch.Generator().manual_seed(5)
    # 24 batched tokens: the 30-token prompt is chunked, and decode mixes into prefill.
    prompts = [torch.randint(3, 160, (n,), generator=gen).tolist() for n in (30, 7, 12)]
    return llm.generate(prompts, GREEDY), counts


def test_forced_fused_gives_the_torch_tokens(checkpoint, monkeypatch):
    plain, plain_counts = _run(checkpoint, monkeypatch, "off")
    got, counts = _run(checkpoint, monkeypatch, "on")
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    for a, b in zip(got, plain, strict=True):  # fp32: kernels agree to a few ulps
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    assert plain_counts == {"rms_norm": 0, "silu_and_mul": 0, "qk_rope_": 0,
                            "store_kv": plain_counts["store_kv"]} and plain_counts["store_kv"] > 0
    layers, steps = 2, counts["qk_rope_"] // 2
    assert steps > 0 and counts["qk_rope_"] == layers * steps
    assert counts["silu_and_mul"] == layers * steps
    assert counts["rms_norm"] == (2 * layers + 1) * steps  # qk-norm is inside the RoPE kernel
    assert counts["store_kv"] == 0  # the RoPE kernel wrote K/V
