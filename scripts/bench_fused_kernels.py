#!/usr/bin/env python
"""Each fused elementwise kernel against the unfused torch ops it replaces, on one GPU.

Shapes of a decode step of Qwen3-0.6B (batch 64) and Llama-3-8B (batch 32), and of their
512-token prefills. Each op is checked against the torch path first (max abs difference),
then timed with ``triton.testing.do_bench`` (median, eager launches) and
``do_bench_cudagraph`` (median, replayed as the engine replays decode steps). The unfused
side is the model's own torch code path (RMSNorm as cast/pow/mean/rsqrt/mul, the residual
add, SiLU * up, the cos/sin gather and rotate-half, qk-norm, then the Triton KV write).
Imports only torch and triton (the repo's kernels/ folder directly). Table last.

    python scripts/bench_fused_kernels.py --out /tmp/fused.md     # H200, ~1 min
    python scripts/bench_fused_kernels.py --dry-run               # CPU, interpreted, tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
# name: (hidden, heads, kv heads, head_dim, intermediate, qk-norm, decode batch, layers)
SHAPES = {
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, True, 64, 28),
    "llama3-8b": (4096, 32, 8, 128, 14336, False, 32, 32),
}
DRY_SHAPES = {"dry": (48, 4, 2, 16, 40, True, 3, 2)}
PROMPT = 512


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET, tiny shapes")
    p.add_argument("--no-prefill", action="store_true", help="decode shapes only")
    p.add_argument("--out", help="also write the table (markdown) here")
    return p.parse_args(argv)


def _norm(x, w, eps=1e-6):  # pdflow.model.layers.RMSNorm, 16-bit path
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def _rotate(x, cos, sin):  # pdflow.model.rope._rotate
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def cases(shape, tokens, dev, dtype, k):
    """(op name, unfused fn, fused fn, check fn -> max abs diff) for one shape."""
    hid, hq, hkv, d, inter, qk_norm, _, _ = shape
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*s):
        return torch.randn(*s, generator=g, device=dev).to(dtype)

    x, res, w = rand(tokens, hid), rand(tokens, hid), rand(hid)
    gu = rand(tokens, 2 * inter)
    qkv = rand(tokens, (hq + 2 * hkv) * d)
    qw, kw = rand(d), rand(d)
    max_pos = 4096
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    freqs = torch.arange(max_pos, device=dev).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    pos = torch.randint(0, max_pos, (tokens,), device=dev, generator=g)
    page, nb = 128, -(-tokens // 128) + 1
    kc = torch.zeros(nb, 1, hkv, page, d, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(nb * page, device=dev, generator=g)[:tokens]

    def rope_unfused(buf):
        t = buf.shape[0]
        c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
        if qk_norm:
            q, kk, v = buf.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, kk = _rotate(_norm(q.view(t, -1, d), qw), c, s), _rotate(_norm(kk.view(t, -1, d), kw), c, s)
        else:
            qk = _rotate(buf[:, : (hq + hkv) * d].view(t, -1, d), c, s)
            q, kk = qk.split([hq, hkv], dim=1)
            v = buf[:, (hq + hkv) * d:]
        k.store_kv(kk, v.view(t, hkv, d), kc, vc, slots)
        return q, kk

    def rope_fused(buf):
        return k.qk_rope_(buf, pos, cos, sin, hq, hkv, d, q_weight=qw if qk_norm else None,
                          k_weight=kw if qk_norm else None, k_cache=kc, v_cache=vc,
                          slot_mapping=slots)[:2]

    def rope_check():
        a, b = rope_unfused(qkv.clone()), rope_fused(qkv.clone())
        return max(float((a[i].float() - b[i].float()).abs().max()) for i in range(2))

    def pair_check(f, u):
        a, b = u(), f()
        a, b = (a, b) if isinstance(a, torch.Tensor) else (a[0], b[0])
        return float((a.float() - b.float()).abs().max())

    norm_u, norm_f = (lambda: _norm(x, w)), (lambda: k.rms_norm(x, w, 1e-6))
    add_u = lambda: (lambda s: (_norm(s, w), s))(x + res)  # noqa: E731
    add_f = lambda: k.rms_norm(x, w, 1e-6, res)  # noqa: E731
    silu_u = lambda: (lambda a, b: torch.nn.functional.silu(a) * b)(*gu.chunk(2, dim=-1))  # noqa: E731
    silu_f = lambda: k.silu_and_mul(gu)  # noqa: E731
    rope_name = "qk-norm + RoPE + KV write" if qk_norm else "RoPE + KV write"
    return [
        ("RMSNorm", norm_u, norm_f, lambda: pair_check(norm_f, norm_u)),
        ("residual add + RMSNorm", add_u, add_f, lambda: pair_check(add_f, add_u)),
        ("SiLU-and-mul", silu_u, silu_f, lambda: pair_check(silu_f, silu_u)),
        (rope_name, lambda: rope_unfused(qkv), lambda: rope_fused(qkv), rope_check),
    ]


def timer(dry: bool):
    if dry:
        def wall(fn):
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return wall, None
    from triton.testing import do_bench, do_bench_cudagraph

    def graphed(fn):  # its stream does not wait for the current one, where the inputs were made
        torch.cuda.synchronize()
        return do_bench_cudagraph(fn, return_mode="median")

    return (lambda fn: do_bench(fn, return_mode="median"), graphed)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))  # the repo's kernels/ folder, not an installed one
    import triton

    from kernels import qk_rope, rms_norm, silu_and_mul, store_kv

    kernels = SimpleNamespace(  # the kernels under test
        rms_norm=rms_norm.rms_norm, silu_and_mul=silu_and_mul.silu_and_mul,
        qk_rope_=qk_rope.qk_rope_, store_kv=store_kv.store_kv,
    )

    dev = "cpu" if args.dry_run else "cuda"
    eager, graph = timer(args.dry_run)
    rows, failures = [], 0
    for name, shape in (DRY_SHAPES if args.dry_run else SHAPES).items():
        batch, layers = shape[6], shape[7]
        phases = [("decode", batch)] + ([] if args.no_prefill else [("prefill", batch * PROMPT)])
        if args.dry_run:
            phases = [("decode", batch), ("prefill", 2 * batch)]
        for phase, tokens in phases:
            for op, unfused, fused, check in cases(shape, tokens, dev, torch.bfloat16, kernels):
                row = dict(shape=name, phase=phase, tokens=tokens, op=op, layers=layers)
                try:
                    row["err"] = check()
                    row["u_eager"], row["f_eager"] = eager(unfused), eager(fused)
                    if graph is not None:
                        row["u_graph"], row["f_graph"] = graph(unfused), graph(fused)
                except Exception as exc:  # one row fails, the table still prints
                    failures += 1
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:150]}"
                rows.append(row)
                print(row, flush=True)
    text = render(rows, dev, triton.__version__)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print("\n" + text, flush=True)
    return 1 if failures else 0


def _us(ms):
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def render(rows, dev, triton_version) -> str:
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "CPU (interpreted: not timings)"
    lines = [f"fused kernels vs unfused torch ops on {name}, torch {torch.__version__}, triton "
             f"{triton_version}, bf16; medians in us (do_bench eager / do_bench_cudagraph)", "",
             "| shape | phase | tokens | op | max abs diff | unfused eager | fused eager | x | "
             "unfused graph | fused graph | x |", "|---" * 11 + "|"]
    steps: dict[tuple, list[float]] = {}
    for r in rows:
        head = f"| {r['shape']} | {r['phase']} | {r['tokens']} | {r['op']} |"
        if "error" in r:
            lines.append(f"{head} FAILED: {r['error']} |" + " |" * 6)
            continue
        sx = r["u_eager"] / r["f_eager"]
        gx = f"{r['u_graph'] / r['f_graph']:.2f}" if "u_graph" in r else "-"
        lines.append(f"{head} {r['err']:.3g} | {_us(r['u_eager'])} | {_us(r['f_eager'])} | "
                     f"{sx:.2f} | {_us(r.get('u_graph'))} | {_us(r.get('f_graph'))} | {gx} |")
        # Per decode step: two residual norms and one of each other op per layer (the
        # plain norm stands once, for the final norm).
        per_layer = 2 if r["op"] == "residual add + RMSNorm" else 1
        count = 1 if r["op"] == "RMSNorm" else per_layer * r["layers"]
        key = (r["shape"], r["phase"])
        acc = steps.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        for i, field in enumerate(("u_eager", "f_eager", "u_graph", "f_graph")):
            acc[i] += count * r.get(field, 0.0)
    lines += ["", "| shape | phase | elementwise ms per step, unfused -> fused (eager) | (graph) |",
              "|---|---|---|---|"]
    for (shape, phase), (ue, fe, ug, fg) in steps.items():
        graph = f"{ug:.3f} -> {fg:.3f}" if ug else "-"
        lines.append(f"| {shape} | {phase} | {ue:.3f} -> {fe:.3f} | {graph} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
