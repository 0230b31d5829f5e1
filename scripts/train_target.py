"""Train pdflow's shipped target: a tiny GQA Llama on generated arithmetic + retrieval.

Imports only torch, transformers, tokenizers and pdflow.bench.tasks (stdlib-only), so it
runs from a source tree on a bare GPU machine, pdflow not installed. `--steps 0` sizes the
run from measured step time and `--time-budget-s`; the steps it chose are saved in
pdflow_training.json, and passing them back as `--steps N` reproduces the run.

    python scripts/train_target.py --out /tmp/tiny --time-budget-s 390
    python scripts/train_target.py --out /tmp/tiny-smoke --smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch
import transformers
from torch.utils.data import DataLoader, IterableDataset
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

if importlib.util.find_spec("pdflow") is None:  # a source tree: after site-packages, where the
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # top-level kernels/ shadows nothing

from pdflow.bench.tasks import training_text
from pdflow.bench.tasks import vocab as V

GEOMETRY = dict(  # conf/model/tiny.yaml
    hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, vocab_size=V.VOCAB_SIZE,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=64, help="rows of --seq-len per step")
    ap.add_argument("--steps", type=int, default=0, help="0: fit the time budget after calibrating")
    ap.add_argument("--time-budget-s", type=float, default=390.0, help="training loop wall clock cap (<= 0: none)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--retrieval-fraction", type=float, default=0.35)
    ap.add_argument("--workers", type=int, default=-1, help="data loader processes (0: inline; -1: 6, smoke 0)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--calibrate-steps", type=int, default=30, help="steps timed before sizing the run")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: few steps, short rows")
    args = ap.parse_args(argv)
    if not args.steps and args.time_budget_s <= 0 and not args.smoke:
        ap.error("--steps 0 sizes the run from --time-budget-s, which must then be > 0")
    if args.smoke:
        args.seq_len, args.batch_size, args.warmup = 256, 4, 2
        args.steps = args.steps or 4
        args.log_every = 1
    if args.workers < 0:
        args.workers = 0 if args.smoke else 6
    return args


class DocStream(IterableDataset):
    """Endless training rows (input ids, labels); each worker draws from its own seed."""

    def __init__(self, seed: int, seq_len: int, retrieval_fraction: float) -> None:
        self.seed, self.seq_len, self.retrieval_fraction = seed, seq_len, retrieval_fraction

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        rng = random.Random(f"train:{self.seed}:{wid}:{nw}")
        while True:
            text, eos = training_text(rng, self.seq_len, retrieval_fraction=self.retrieval_fraction)
            ids = bytes([V.BOS_ID]) + V.encode(text) + (bytes([V.EOS_ID]) if eos else b"")
            ids = ids[: self.seq_len]
            row = torch.full((self.seq_len,), V.PAD_ID, dtype=torch.long)
            row[: len(ids)] = torch.frombuffer(bytearray(ids), dtype=torch.uint8).long()
            labels = row.clone()
            labels[len(ids):] = -100
            yield row, labels


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    """Linear warmup then cosine down to min_lr_ratio * lr at `total`."""
    warmup = max(1, args.warmup)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        **GEOMETRY,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=V.BOS_ID,
        eos_token_id=V.EOS_ID,
        pad_token_id=V.PAD_ID,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace, fused: bool):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def save(model: LlamaForCausalLM, out: Path, record: dict, max_positions: int) -> None:
    """Standard HF files: bf16 safetensors in <12 MB shards, tokenizer, generation config."""
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.use_cache = True
    model.save_pretrained(out, max_shard_size="10MB")
    # config.json's dtype is the one to compute in, which pdflow's dtype="auto" and
    # transformers' default load: fp32, as conf/model/tiny.yaml says; the shards stay
    # bf16 (its weight_dtype).
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config["dtype"] = "float32"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=V.BOS_ID, eos_token_id=V.EOS_ID, pad_token_id=V.PAD_ID, do_sample=False,
        max_new_tokens=320,
    ).save_pretrained(out)
    V.save_tokenizer(out, model_max_length=max_positions)
    (out / "pdflow_training.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.manual_seed_all(args.seed)
    loader = DataLoader(
        DocStream(args.seed, args.seq_len, args.retrieval_fraction),
        batch_size=args.batch_size, num_workers=args.workers, pin_memory=cuda,
        prefetch_factor=8 if args.workers else None, persistent_workers=args.workers > 0,
    )
    it = iter(loader)  # fork the data workers before CUDA is initialised
    model = build_model(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, args, fused=cuda)
    tokens_per_step = args.batch_size * args.seq_len
    print(f"params {n_params/1e6:.2f}M device {device} tokens/step {tokens_per_step} "
          f"torch {torch.__version__} transformers {transformers.__version__}", flush=True)
    total = args.steps or 10**9
    calib_at, calib_from, t_calib0 = args.calibrate_steps, args.calibrate_steps // 3, None
    t_loop = time.time()
    step = 0
    model.train()
    while step < total:
        x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args)  # total is "infinite" until calibrated
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if not args.steps and step == calib_from:
            if cuda:
                torch.cuda.synchronize()
            t_calib0 = time.time()
        if not args.steps and step == calib_at:
            if cuda:
                torch.cuda.synchronize()
            per_step = (time.time() - t_calib0) / (calib_at - calib_from)
            left = args.time_budget_s - (time.time() - t_loop)
            total = step + max(1, int(0.97 * left / per_step))
            print(f"calibrated: {per_step*1e3:.1f} ms/step, {tokens_per_step/per_step/1e6:.2f}M tok/s "
                  f"-> {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            loss_val = loss.item()
            el = time.time() - t_loop
            print(f"step {step}/{total} loss {loss_val:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"elapsed {el:.0f}s tok/s {step*tokens_per_step/el/1e6:.2f}M", flush=True)
        if args.time_budget_s > 0 and time.time() - t_loop > args.time_budget_s:
            print(f"time budget reached at step {step} of {total}", flush=True)
            break
    loss_val = loss.item()
    train_s = time.time() - t_loop
    record = {
        "seed": args.seed, "steps": step, "planned_steps": total, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "tokens": step * tokens_per_step, "lr": args.lr,
        "warmup": args.warmup, "min_lr_ratio": args.min_lr_ratio, "weight_decay": args.weight_decay,
        "retrieval_fraction": args.retrieval_fraction, "workers": args.workers,
        "final_loss": loss_val, "train_seconds": round(train_s, 1), "params": n_params,
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": sys.version.split()[0], "smoke": args.smoke,
        "reproduce": f"python scripts/train_target.py --out OUT --seed {args.seed} "
                     f"--steps {step} --time-budget-s 0 --seq-len {args.seq_len} --batch-size {args.batch_size} "
                     f"--lr {args.lr} --warmup {args.warmup} --retrieval-fraction {args.retrieval_fraction} "
                     f"--workers {args.workers}",
    }
    save(model, Path(args.out), record, args.max_positions)
    print(f"saved {args.out}: {step} steps, {step*tokens_per_step/1e6:.1f}M tokens, loss {loss_val:.4f}, "
          f"train {train_s:.0f}s total {time.time()-t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
