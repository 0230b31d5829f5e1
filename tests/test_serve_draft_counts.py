"""Speculative decoding is visible through the API: a completion's usage carries its
drafted/accepted counts and /metrics the acceptance, as the workloads read them."""

from __future__ import annotations

import httpx
import pytest

from pdflow import compose
from pdflow.serve.launch import serve_spec

pytestmark = pytest.mark.slow
PROMPT = ("Question: Mira has 12 apples. Mira buys 7 more apples. How many apples does Mira have now?\n"
          "Answer: Mira has 12 + 7 = 19 apples. The answer is 19.\n\nQuestion: Omar has 30 shells. "
          "Omar loses 4 shells. How many shells does Omar have now?\nAnswer:")


def test_usage_and_metrics_carry_the_drafters_counts():
    spec = compose(["mode=monolithic", "prefill=tp1", "decode=tp1", "drafter=dspark", "tracking=off",
                    "serve.port=0"])
    with serve_spec(spec) as served:
        body = httpx.post(f"{served.url}/v1/completions", timeout=120, json={
            "model": served.model_name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}).json()
        usage = body["usage"]
        assert usage["num_verify_steps"] >= 1
        assert 0 <= usage["num_accepted_draft_tokens"] <= usage["num_draft_tokens"]
        assert usage["completion_tokens"] == usage["num_accepted_draft_tokens"] + usage["num_verify_steps"] + 1
        # The shipped drafter predicts this arithmetic well: most drafts are accepted.
        assert usage["num_accepted_draft_tokens"] > usage["num_verify_steps"]
        metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
    accepted = [line for line in metrics.splitlines() if line.startswith("pdflow_accepted_draft_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) == usage["num_accepted_draft_tokens"]
