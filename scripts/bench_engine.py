#!/usr/bin/env python
"""Engine vs transformers.generate vs the roofline: same random-init checkpoint, same
prompts, greedy, fixed output length (EOS ignored), page 128, prefix caching off.

Prints, per shape: transformers tok/s, pdflow tok/s (fused kernels on and/or off) and
their ratio, the roofline of the run (prefill FLOPs at a GEMM rate and each decode step's
weight + live-KV bytes at an HBM copy rate, both measured in this run) and pdflow's share
of it, start-up, first vs second full run, time to the first tokens and the decode step.
Each row fails on its own (the table says why); the table comes last.

    python scripts/bench_engine.py --shape qwen3-0.6b,llama3-8b --fused both   # H200, ~3 min
    python scripts/bench_engine.py --shape qwen3-0.6b --overlap both            # overlap on vs off
    python scripts/bench_engine.py --shape qwen3-30b-a3b --fused on             # H200, MoE
    python scripts/bench_engine.py --shape qwen3-30b-a3b --fused on --layers 12 # 1/4 the bytes
    python scripts/bench_engine.py --shape qwen3-30b-a3b --kv-dtype fp8_e4m3    # MoE, fp8 KV
    python scripts/bench_engine.py --shape tiny --device cpu                     # CPU
    python scripts/bench_engine.py --model PATH --batch 8 --prompt-len 256 --output-len 64
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # fused kernels on CPU run interpreted: set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

# name: (family, HF config fields, (batch, prompt_len, output_len)) for the named shapes.
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1_000_000.0, max_position_embeddings=40960), (64, 512, 256)),
    "llama3-8b": ("llama", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500_000.0, max_position_embeddings=8192), (32, 512, 128)),
    # conf/model/qwen3-30b-a3b: 128 experts, top-8, all 48 layers sparse (issue 35).
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        rope_theta=1_000_000.0, max_position_embeddings=40960), (64, 512, 256)),
    # A few-expert stand-in of that family for CPU runs of the script.
    "tiny-moe": ("qwen3_moe", dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, vocab_size=256, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        max_position_embeddings=1024), (4, 32, 16)),
    # The shipped model's geometry (conf/model/tiny): the CPU stand-in.
    "tiny": ("llama", dict(
        hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=768, vocab_size=128, tie_word_embeddings=False,
        max_position_embeddings=1024), (16, 96, 64)),
}
FUSED_ENV = "PDFLOW_FUSED_KERNELS"  # pdflow.model.fused.ENV, read when a model is built


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--model", help="HF checkpoint folder instead of a named shape")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch", type=int, help="default: the shape's workload")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--page-tokens", type=int, default=128)
    p.add_argument("--attention-backend", help="default: triton on CUDA, torch on CPU")
    p.add_argument("--fused", default="auto", choices=["auto", "on", "off", "both"],
                   help="pdflow's fused kernels (both: one pdflow row each, on then off)")
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off", "both"],
                   help="overlap scheduling (ParallelSpec.overlap_scheduling; auto: on for one "
                   "CUDA rank; both: one pdflow row each, on then off)")
    p.add_argument("--kv-dtype", default="auto",
                   help="pdflow's KV cache dtype (auto: the weights'; fp8_e4m3: fp8 with scales)")
    p.add_argument("--layers", type=int,
                   help="keep the shape's geometry but build this many decoder layers (a "
                   "48-layer 30B-A3B checkpoint is ~61 GB: more than a 64 GiB disk holds)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the final table (markdown) here")
    args = p.parse_args(argv)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.attention_backend is None:
        args.attention_backend = "triton" if args.device.startswith("cuda") else "torch"
    shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad and not args.model:
        p.error(f"unknown shape(s) {bad}; choose from {sorted(SHAPES)} or pass --model")
    args.shapes = ["model"] if args.model else shapes
    return args


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def measure_rates(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s counting read + write) on this device, now."""
    cuda = device.startswith("cuda")
    n, copy_bytes, reps = (8192, 1 << 30, 10) if cuda else (512, 64 << 20, 3)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    flops = 2.0 * n**3 / best(lambda: a @ b)
    bandwidth = 2.0 * copy_bytes / best(lambda: dst.copy_(src))
    return flops, bandwidth


def write_checkpoint(folder: Path, shape: str, device: str, dtype: torch.dtype, seed: int,
                     layers: int | None = None):
    """A random-init HF model of the shape, built on ``device`` in ``dtype`` and saved with
    ``save_pretrained``; returned too, to serve as the transformers baseline."""
    import transformers

    family, fields, _ = SHAPES[shape]
    common = dict(fields, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    if layers:
        common["num_hidden_layers"] = layers
    if family == "qwen3":
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        cfg, cls = transformers.Qwen3MoeConfig(**common), transformers.Qwen3MoeForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder)
    return model.eval()


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, prompt_len), generator=gen).tolist()


def run_transformers(model, prompts, output_len: int, device: str) -> dict:
    model.generation_config.eos_token_id = None  # run the full length, like ignore_eos
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding

    def generate(n: int):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=n, do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        generate(2)  # warm-up
        sync(device)
        start = time.perf_counter()
        out = generate(output_len)
        sync(device)
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, tokens=out[:, ids.shape[1]:].tolist())


def timed_run(llm, prompts, params, device: str) -> dict:
    """One full batch through the public API, timing when each output position first
    arrives: position 0 comes from the prefill, each later one from a decode step."""
    sync(device)
    start = time.perf_counter()
    ids = llm.submit(prompts, params)
    arrival: dict[int, float] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    for out in llm.run():
        arrival.setdefault(out.index, time.perf_counter())
        tokens[out.request_id].append(out.token_id)
    sync(device)
    seconds = time.perf_counter() - start
    times = [arrival[i] for i in sorted(arrival)]
    steps = [b - a for a, b in itertools.pairwise(times)]
    return dict(seconds=seconds, prefill_s=times[0] - start if times else float("nan"),
                step_s=statistics.median(steps) if steps else float("nan"),
                tokens=[tokens[rid] for rid in ids])


OVERLAP = {"auto": None, "on": True, "off": False}


def run_pdflow(folder: Path, prompts, args, fused: str, overlap: str = "auto") -> dict:
    from pdflow import LLM, SamplingParams
    from pdflow.spec import ParallelSpec

    os.environ[FUSED_ENV] = fused
    longest = max(map(len, prompts)) + args.output_len
    blocks = len(prompts) * -(-longest // args.block_size) + 8
    cuda = args.device.startswith("cuda")
    gib = torch.cuda.get_device_properties(0).total_memory / (1 << 30) if cuda else 4.0
    spec = ParallelSpec(
        block_size=args.block_size, kv_page_tokens=args.page_tokens, num_kv_blocks=blocks,
        max_num_batched_tokens=max(8192, sum(map(len, prompts))), max_num_seqs=len(prompts),
        device=args.device, attention_backend=args.attention_backend, memory=0.9,
        device_memory_gib=gib, enable_prefix_caching=False, overlap_scheduling=OVERLAP[overlap],
        kv_dtype=args.kv_dtype,
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    llm = LLM(str(folder), spec, dtype=args.dtype, max_model_len=longest + args.block_size)
    startup = time.perf_counter() - start
    try:
        stage = getattr(llm.instance.executor, "stage", None)  # in-process runs only: a report
        model = stage.model if stage is not None else None
        fused_on = None if model is None else model.uses_fused_kernels(
            torch.empty(0, device=args.device))
        overlap_on = llm.instance.executor.overlap
        first = timed_run(llm, prompts, params, args.device)
        second = timed_run(llm, prompts, params, args.device)
    finally:
        llm.shutdown()
        del llm
        free_memory(args.device)
    return dict(second, startup_s=startup, first_s=first["seconds"], fused_on=fused_on, overlap_on=overlap_on)


def matching(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    return f"{same}/{len(a)}"


def soft(label: str, fn, failures: dict):
    """Run one measurement; on any error record it and carry on with the others."""
    try:
        return fn()
    except Exception as exc:  # a row fails, the run goes on
        traceback.print_exc()
        failures[label] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return None


def bench_shape(shape: str, args, rates, failures: dict) -> list[dict]:
    from pdflow.bench.roofline import Workload, roofline
    from pdflow.model.config import DecoderConfig

    dtype = getattr(torch, args.dtype)
    defaults = SHAPES[shape][2] if shape in SHAPES else (16, 128, 64)
    batch = args.batch or defaults[0]
    prompt_len, output_len = args.prompt_len or defaults[1], args.output_len or defaults[2]
    args.output_len = output_len
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            folder, hf_model = Path(args.model), None
        else:
            folder = Path(tmp)
            hf_model = soft(f"{shape} checkpoint",
                            lambda: write_checkpoint(folder, shape, args.device, dtype, args.seed,
                                                     args.layers),
                            failures)
            if hf_model is None:
                return [dict(shape=shape, run="checkpoint", error=failures[f"{shape} checkpoint"])]
        cfg = DecoderConfig.from_file(folder)
        prompts = make_prompts(batch, prompt_len, cfg.vocab_size, args.seed)
        print(f"[{shape}] {cfg.architecture} layers={cfg.num_layers} hidden={cfg.hidden_size} "
              f"heads={cfg.num_heads}/{cfg.num_kv_heads} d={cfg.head_dim} vocab={cfg.vocab_size} "
              f"{args.dtype}; batch {batch}, prompt {prompt_len}, output {output_len}", flush=True)
        hf = None
        if not args.skip_transformers:
            def transformers_row():
                import transformers

                model = hf_model or transformers.AutoModelForCausalLM.from_pretrained(
                    folder, dtype=dtype).to(args.device)
                return run_transformers(model, prompts, output_len, args.device)

            hf = soft(f"{shape} transformers", transformers_row, failures)
        hf_model = None
        free_memory(args.device)
        generated = batch * output_len
        if hf is not None:
            rows.append(dict(shape=shape, run="transformers", tok_s=generated / hf["seconds"],
                             second_s=hf["seconds"]))
        else:
            rows.append(dict(shape=shape, run="transformers",
                             error=failures.get(f"{shape} transformers", "skipped")))
        roof = None
        if rates is not None:
            work = Workload(batch=batch, prompt_len=prompt_len, output_len=output_len,
                            dtype_bytes=dtype.itemsize)
            roof = roofline(cfg, work, flops_per_s=rates[0], bytes_per_s=rates[1])
            rows.append(dict(shape=shape, run="roofline", tok_s=generated / roof.total_s,
                             second_s=roof.total_s, prefill_s=roof.prefill_s,
                             step_s=roof.step_s))
        fused = ["on", "off"] if args.fused == "both" else [args.fused]
        overlaps = ["on", "off"] if args.overlap == "both" else [args.overlap]
        first_pdflow = None
        for setting, overlap in itertools.product(fused, overlaps):
            run = f"pdflow fused={setting} overlap={overlap}"
            label = f"{shape} {run}"
            res = soft(label, lambda s=setting, o=overlap: run_pdflow(folder, prompts, args, s, o), failures)
            if res is None:
                rows.append(dict(shape=shape, run=run, error=failures[label]))
                continue
            row = dict(shape=shape, run=run, tok_s=generated / res["seconds"],
                       second_s=res["seconds"], first_s=res["first_s"], startup_s=res["startup_s"],
                       prefill_s=res["prefill_s"], step_s=res["step_s"], fused_on=res["fused_on"],
                       overlap_on=res["overlap_on"])
            same = []
            if hf is not None:
                row["vs_hf"] = row["tok_s"] / rows[0]["tok_s"]
                same.append(f"{matching(res['tokens'], hf['tokens'])} transformers")
            if first_pdflow is not None:
                same.append(f"{matching(res['tokens'], first_pdflow[1])} {first_pdflow[0]}")
            row["same"] = "; ".join(same) or "-"
            if roof is not None:
                row["roof_share"] = row["tok_s"] * roof.total_s / generated
            first_pdflow = first_pdflow or (f"fused={setting} overlap={overlap}", res["tokens"])
            rows.append(row)
    return rows


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def table(rows: list[dict]) -> str:
    head = ("| shape | run | tok/s | x transformers | roofline share | start-up s | "
            "first run s | second run s | first/second | prefill ms | decode step ms | "
            "same tokens |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['run']} | FAILED: {r['error']} |" + " |" * 9)
            continue
        ratio = r["first_s"] / r["second_s"] if r.get("first_s") else None
        run = r["run"]
        for key, value in (("fused", r.get("fused_on")), ("overlap", r.get("overlap_on"))):
            if value is not None:  # what auto resolved to
                run = run.replace(f"{key}=auto", f"{key}=auto ({'on' if value else 'off'})")
        lines.append(
            f"| {r['shape']} | {run} | {_fmt(r.get('tok_s'), ',.0f' if r['tok_s'] >= 100 else '.3g')} | "
            f"{_fmt(r.get('vs_hf'), '.2f')} | {_fmt(r.get('roof_share'), '.1%')} | "
            f"{_fmt(r.get('startup_s'), '.2f')} | {_fmt(r.get('first_s'), '.2f')} | "
            f"{_fmt(r.get('second_s'), '.2f')} | {_fmt(ratio, '.2f')} | "
            f"{_fmt(r.get('prefill_s'), '.1f', 1e3)} | {_fmt(r.get('step_s'), '.2f', 1e3)} | "
            f"{r.get('same', '-')} |")
    return "\n".join(lines)


def git_commit() -> str:
    """``PDFLOW_GIT_COMMIT`` wins: a copy of the tree without its history (a device
    machine's) would name a stale commit."""
    if os.environ.get("PDFLOW_GIT_COMMIT"):
        return os.environ["PDFLOW_GIT_COMMIT"][:7]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    failures: dict[str, str] = {}
    dtype = getattr(torch, args.dtype)
    rates = soft("rates", lambda: measure_rates(args.device, dtype), failures)
    rows: list[dict] = []
    for shape in args.shapes:
        rows += bench_shape(shape, args, rates, failures)
        free_memory(args.device)
    import transformers
    import triton

    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else (
        platform.processor() or platform.machine())
    rate_text = ("rates: failed" if rates is None else
                 f"measured: GEMM {rates[0] / 1e12:.3g} TFLOP/s ({args.dtype}), "
                 f"copy {rates[1] / 1e12:.3g} TB/s (read + write)")
    header = (f"bench_engine on {device}, torch {torch.__version__}, triton {triton.__version__}, "
              f"transformers {transformers.__version__}, commit {git_commit()}; backend "
              f"{args.attention_backend}, page {args.page_tokens}/{args.block_size}, "
              f"greedy, ignore_eos, prefix caching off\n{rate_text}")
    text = header + "\n\n" + table(rows)
    if failures:
        text += "\n\nfailed: " + "; ".join(f"{k}: {v}" for k, v in failures.items())
    if args.out:
        Path(args.out).write_text(text + "\n")
    print("\n" + text, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
