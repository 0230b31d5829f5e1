"""scripts/bench_gpu_pd.py's prefill-cost path on CPU at the tiniest size: every requested
layout gives a row with positive figures, the blocks its prefill instance's engine counts
for the prompt, and ratios against the TP2 drafter-off row of the same run."""

from __future__ import annotations

import bench_gpu_pd  # scripts/ is on sys.path (conftest)

PROMPT = 200  # two 128-token blocks


def test_prefill_cost_rows_are_measured_per_layout():
    args = bench_gpu_pd.parse_args(["--table", "prefill-cost", "--device", "cpu", "--shape", "tiny",
                                    "--prompt-len", str(PROMPT), "--requests", "3", "--concurrency", "2",
                                    "--rows", "pp2:none"])
    with bench_gpu_pd.model_overrides(args) as model:
        rows = bench_gpu_pd.prefill_cost_rows(args, model)
    assert [(r["layout"], r["drafter"]) for r in rows] == [("tp2", "none"), ("pp2", "none")]
    for row in rows:
        assert "error" not in row, row["error"]
        assert row["completed"] == 3 and not row["errors"]
        assert row["prompt_tok_s"] > 0 and row["ttft_mean_s"] > 0 and row["kv_mib_per_request"] > 0
        assert row["blocks_per_request"] == -(-PROMPT // 128)
        assert row["pool_blocks"] >= row["blocks_per_request"]
        assert sum(row["partition"]) == 8  # the tiny model's layers, all placed
        # Nothing held on either instance once every request finished (cached blocks count free).
        assert row["blocks_held_after"] == {"prefill": 0, "decode": 0}
    assert rows[0]["tok_s_ratio"] == 1.0 and rows[0]["ttft_ratio"] == 1.0
    assert rows[1]["partition"] == [4, 4]
    assert rows[1]["tok_s_ratio"] == rows[1]["prompt_tok_s"] / rows[0]["prompt_tok_s"]
