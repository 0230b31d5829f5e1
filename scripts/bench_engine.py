#!/usr/bin/env python
"""Engine vs transformers.generate: same checkpoint, same prompts, greedy, fixed output
length (EOS ignored), in one run. Prints output tokens/s for both and their ratio.

    python scripts/bench_engine.py                      # random-init Llama, CPU, batch 16
    python scripts/bench_engine.py --model PATH --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF checkpoint folder; default: a random Llama in a temp dir")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--attention-backend", default="auto", help="auto: triton on cuda, torch on cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    # Geometry of the random checkpoint (ignored with --model); default: conf/model/tiny,
    # the model pdflow ships and serves on CPU.
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=128)
    return p.parse_args()


def make_prompts(args, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_prompt, args.max_prompt + 1, (args.batch,), generator=gen)
    return [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in lens]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_transformers(folder: Path, prompts, args) -> tuple[float, list[list[int]]]:
    import transformers

    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.to(args.device).eval()
    model.generation_config.eos_token_id = None  # run the full length, like ignore_eos
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    ids, mask = ids.to(args.device), mask.to(args.device)

    def generate(n: int):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                              do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        generate(2)  # warm-up
        sync(args.device)
        start = time.perf_counter()
        out = generate(args.output_len)
        sync(args.device)
    return time.perf_counter() - start, out[:, width:].tolist()


def run_engine(folder: Path, prompts, args) -> tuple[float, list[list[int]], int]:
    from pdflow import LLM, SamplingParams
    from pdflow.spec import ParallelSpec

    need = sum(-(-(len(p) + args.output_len) // args.block_size) for p in prompts)
    spec = ParallelSpec(
        block_size=args.block_size, kv_page_tokens=args.page_tokens, num_kv_blocks=need + 8,
        max_num_batched_tokens=max(2048, sum(map(len, prompts))), max_num_seqs=args.batch,
        device=args.device, attention_backend=args.attention_backend,
        enable_prefix_caching=False,  # random prompts share nothing; keep the runs alike
    )
    llm = LLM(str(folder), spec, dtype=args.dtype)
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts, warm)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    sync(args.device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(args.device)
    return time.perf_counter() - start, [o.token_ids for o in outs], llm.num_kv_blocks


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            folder = Path(args.model)
        else:
            from pdflow.model.hf_checkpoint import write_random_checkpoint

            folder = write_random_checkpoint(
                Path(tmp), family="llama", layers=args.layers, hidden=args.hidden,
                heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                intermediate=args.intermediate, vocab=args.vocab, seed=args.seed,
                tokenizer=False,
            )
        from pdflow.model.config import DecoderConfig
        from pdflow.spec.attention import resolve_attention_backend

        cfg = DecoderConfig.from_file(folder)
        prompts = make_prompts(args, cfg.vocab_size)
        hf_s, hf_tokens = run_transformers(folder, prompts, args)
        ours_s, our_tokens, blocks = run_engine(folder, prompts, args)

    generated = args.batch * args.output_len
    hf_tps, ours_tps = generated / hf_s, generated / ours_s
    same = sum(a == b for a, b in zip(hf_tokens, our_tokens, strict=True))
    print(f"model: {cfg.architecture} layers={cfg.num_layers} hidden={cfg.hidden_size} "
          f"heads={cfg.num_heads}/{cfg.num_kv_heads} vocab={cfg.vocab_size} {args.dtype}")
    print(f"batch={args.batch} prompt={args.min_prompt}..{args.max_prompt} "
          f"output={args.output_len} device={args.device} threads={torch.get_num_threads()} "
          f"kv_blocks={blocks} page={args.page_tokens}/{args.block_size}")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"commit {git_commit()}")
    backend = resolve_attention_backend(args.attention_backend, args.device)
    if args.device == "cpu" and backend == "torch" and args.dtype == "float32":
        from pdflow.attention import cpu_decode  # built by the run above when it can be

        print(f"fused CPU decode op: {'on' if cpu_decode.op() is not None else 'off (gather)'}")
    print(f"transformers.generate: {hf_tps:9.1f} tok/s ({hf_s:.2f} s)")
    print(f"pdflow engine:         {ours_tps:9.1f} tok/s ({ours_s:.2f} s)")
    print(f"ratio (pdflow / transformers): {ours_tps / hf_tps:.2f}x")
    print(f"identical greedy sequences: {same}/{args.batch} "
          "(batched transformers pads, so late tokens may differ by fp noise)")


if __name__ == "__main__":
    main()
