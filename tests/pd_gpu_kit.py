"""What the GPU P/D tests share: a deployment of a composed spec serving four prompts
(5-1000 tokens) greedily, every request without an error and every KV block back after."""

from __future__ import annotations

import torch

from pdflow import Deployment, SamplingParams, compose

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Both instances on the GPUs from 0, a small share of each GPU's memory.
GPU_BASE = ["prefill.device=cuda", "decode.device=cuda", "prefill.device_memory_gib=140",
            "decode.device_memory_gib=140", "prefill.memory=0.05", "decode.memory=0.05", "prefill.device_offset=0"]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(4, 128, (n,), generator=gen).tolist() for n in (5, 70, 300, 1000)]


def serve_greedy(overrides: list[str], check=None) -> tuple[list[list[int]], int]:
    """The greedy tokens of each prompt and the drafts accepted in all; ``check(deployment)``
    runs before anything is served."""
    with Deployment(compose(overrides)) as d:
        if check is not None:
            check(d)
        outs = d.generate(prompts(), GREEDY)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        pools = [(e.num_free_kv_blocks, e.num_kv_blocks) for e in (d.producer, d.consumer) if e is not None]
        assert all(free == total for free, total in pools), pools
        return [o.token_ids for o in outs], sum(o.num_accepted for o in outs)
