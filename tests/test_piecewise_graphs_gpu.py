"""On a GPU, prefill and mixed steps replay as graphs cut at the attention (captured at
warm-up): greedy tokens equal the eager path's, with and without a drafter, and padding
rows write no KV. Run by the lead: ``pytest -m gpu tests/test_piecewise_graphs_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from pdflow import SamplingParams
from pdflow.engine.llm import LLM
from pdflow.spec.load import compose_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BASE = ["mode=monolithic", "decode=tp1", "decode.device=cuda", "tracking=off", "decode.enable_prefix_caching=false"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LENGTHS = [1, 5, 37, 130, 300, 700]


def _prompts(vocab: int) -> list[list[int]]:
    return [[3 + (7 * i + n) % (vocab - 3) for i in range(n)] for n in LENGTHS]


def _run(extra: list[str]):
    with LLM.from_run_spec(compose_spec([*BASE, *extra]), role="decode") as llm:
        stage = llm.engine.instance.executor.stage
        prompts = _prompts(llm.engine.config.vocab_size)
        together = llm.generate(prompts, GREEDY)  # mixed steps
        alone = [llm.generate([p], GREEDY)[0] for p in prompts[:3]]  # prefill steps of one prompt
        replays = stage.piecewise.replays if stage.piecewise is not None else 0
        return together + alone, replays, stage.piecewise is not None


@pytest.mark.parametrize("drafter", ["none", "dspark"])
def test_piecewise_steps_equal_eager(drafter):
    eager, eager_replays, _ = _run([f"drafter={drafter}", "decode.piecewise_graphs=false"])
    pieces, replays, captured = _run([f"drafter={drafter}"])
    assert captured and replays > 0 and eager_replays == 0
    assert [o.token_ids for o in pieces] == [o.token_ids for o in eager]
    for got, want in zip(pieces, eager, strict=True):
        assert got.logprobs == pytest.approx(want.logprobs, abs=2e-2)


def test_padding_rows_write_no_kv():
    """A 37-token prompt runs in a 48-token bucket: only its own slots change."""
    with LLM.from_run_spec(compose_spec([*BASE, "drafter=none", "decode.num_kv_blocks=64"]), role="decode") as llm:
        stage = llm.engine.instance.executor.stage
        assert stage.piecewise is not None and stage.piecewise.pieces
        before = {name: cache.clone() for name, cache in stage.kv.caches.items()}
        prompt = _prompts(llm.engine.config.vocab_size)[2]
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        for name, cache in stage.kv.caches.items():
            # [blocks, pages, heads, page tokens, dim] -> one flag per token slot
            changed = (cache != before[name]).any(-1).any(2)
            assert int(changed.sum()) <= len(prompt), f"{name}: {int(changed.sum())} slots written"
