"""scripts/bench_engine.py end to end on CPU (tiny shape, fused on and off), its fail-soft
rows, and the roofline arithmetic it prices runs with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdflow.bench.roofline import Workload, experts_hit, prefill_flops, roofline, weight_bytes
from pdflow.model.config import DecoderConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_engine.py"


def _bench(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    table = tmp_path / "engine.md"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--shape", "tiny", "--device", "cpu", "--batch", "1",
         "--prompt-len", "6", "--output-len", "3", "--out", str(table), *extra],
        capture_output=True, text=True, timeout=900,
    )
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in table.read_text().splitlines() if line.startswith("| tiny")]
    return out, rows


def test_dry_run_prints_every_row(tmp_path):
    out, rows = _bench(tmp_path, "--fused", "both")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    runs = {r[1]: r for r in rows}
    on, off = "pdflow fused=on overlap=auto (off)", "pdflow fused=off overlap=auto (off)"  # CPU: auto is off
    assert list(runs) == ["transformers", "roofline", on, off]
    for name in ("transformers", "roofline", on, off):
        assert float(runs[name][2].replace(",", "")) > 0  # tok/s
    for name in (on, off):
        row = runs[name]
        assert float(row[4].rstrip("%")) > 0  # share of the roofline
        assert float(row[6]) > 0 and float(row[7]) > 0  # first and second run seconds
        assert float(row[10]) > 0  # decode step ms
    # fp32: the fused kernels (interpreted) give the torch ops' tokens.
    assert "1/1 fused=on overlap=auto" in runs[off][11]
    assert out.stdout.rstrip().endswith(runs[off][11] + " |")  # table last


def test_a_failing_row_is_reported_and_the_rest_still_run(tmp_path):
    out, rows = _bench(tmp_path, "--fused", "off", "--attention-backend", "nope",
                       "--skip-transformers")
    assert out.returncode == 1
    runs = {r[1]: r for r in rows}
    assert "unknown attention backend" in runs["pdflow fused=off overlap=auto"][2]
    assert float(runs["roofline"][2].replace(",", "")) > 0


def test_unknown_shape_is_refused():
    out = subprocess.run([sys.executable, str(SCRIPT), "--shape", "gpt5"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "unknown shape" in out.stderr


# -- roofline arithmetic ------------------------------------------------------------------

TOY = DecoderConfig(vocab_size=3, hidden_size=2, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=2, intermediate_size=2)


def test_roofline_by_hand():
    # qkv 2x(1+2)x2=12, o 2x2=4, gate_up+down 3x2x2=12: 28 matmul weights; 2 norms of 2;
    # final norm 2, head 3x2=6: (28 + 4 + 2 + 6) = 40 weights.
    assert weight_bytes(TOY, 2) == 80
    # 2 seqs x 4 tokens x 2 x 28 + attention 4 x 1 x 2 x (4 x 5 / 2) x 2 seqs + head 2 x 6 x 2.
    assert prefill_flops(TOY, 2, 4) == 2 * 4 * 2 * 28 + 4 * 2 * 10 * 2 + 2 * 6 * 2
    work = Workload(batch=2, prompt_len=4, output_len=3, dtype_bytes=2)
    r = roofline(TOY, work, flops_per_s=1e30, bytes_per_s=1.0)  # memory-bound everywhere
    kv_token = 1 * 2 * 1 * 2 * 2  # layers x (k, v) x heads x d x bytes
    assert r.decode_steps == 2
    assert r.decode_kv_bytes == kv_token * 2 * (5 + 6)  # steps read 5 then 6 tokens per seq
    assert r.decode_s == pytest.approx(2 * 80 + r.decode_kv_bytes)
    assert r.prefill_s == pytest.approx(80)


def test_moe_roofline_reads_the_experts_a_step_hits():
    """A sparse layer: router (E x hidden) plus the experts the step's rows hit: k for one
    row, all but a few of 128 for 64 rows of top-8 (Qwen3-30B-A3B)."""
    moe = DecoderConfig(architecture="Qwen3MoeForCausalLM", vocab_size=3, hidden_size=2, num_layers=2,
                        num_heads=1, num_kv_heads=1, head_dim=2, intermediate_size=2, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=3, mlp_only_layers=[0])
    # attention 16 + norms 4 per layer; layer 0 dense 12; layer 1 router 8 + 2 experts x 18;
    # final norm 2, head 6.
    assert weight_bytes(moe, 1, tokens=1) == 2 * 20 + 12 + 8 + 2 * 18 + 2 + 6
    assert experts_hit(moe, 1) == 2 and 4 > experts_hit(moe, 3) > experts_hit(moe, 2) > 2
    a3b = DecoderConfig(architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
                        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
                        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, qk_norm=True)
    # 3.3B active parameters less the embedding (0.31B, only gathered)
    assert 3.0e9 < weight_bytes(a3b, 1, tokens=1) < 3.1e9
    assert 125 < experts_hit(a3b, 64) < 127


def test_roofline_matches_the_issue_figures():
    """Issue 15 priced Qwen3-0.6B (B64, 512 in, 256 out) at about 41k tok/s and Llama-3-8B
    (B32, 512 in, 128 out) at about 4.8k, at 730 TFLOP/s and 4.2-4.4 TB/s."""
    qwen = DecoderConfig(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024,
                         num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                         intermediate_size=3072, qk_norm=True, tie_word_embeddings=True)
    llama = DecoderConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                          num_kv_heads=8, head_dim=128, intermediate_size=14336)
    for cfg, (b, p, o), want in ((qwen, (64, 512, 256), 41_000), (llama, (32, 512, 128), 4_800)):
        work = Workload(batch=b, prompt_len=p, output_len=o, dtype_bytes=2)
        r = roofline(cfg, work, flops_per_s=730e12, bytes_per_s=4.25e12)
        assert b * o / r.total_s == pytest.approx(want, rel=0.05)
