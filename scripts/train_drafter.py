"""Train pdflow's drafters (dspark, eagle, eagle3) against the shipped target.

The target (HF files, frozen) reads generated training documents; its hidden states at
the drafter's taps (dspark: the graph's taps; eagle3: low/mid/high layers, saved in its
checkpoint; eagle: the final normed hidden state) feed the drafter's dense training
path, which computes exactly what the paged serving path computes (tested). Labels are
the target's own argmax, so the loss is what greedy acceptance rewards. Acceptance is
then measured on held-out arithmetic prompts: the target's greedy continuations are
replayed through the saved (reloaded) drafter with the serving loop's arithmetic
(anchor, k drafts, accept the matching prefix, move by accepted + 1).

    python scripts/train_drafter.py --kinds dspark     # GPU: ~7 min training + eval; then eagle, eagle3
    python scripts/train_drafter.py --smoke --steps 5 --out-root /tmp/drafters  # CPU pipeline check

Writes ``<out-root>/<target>-<kind>/`` (config.json, model.safetensors, README.md,
pdflow_training.json); load with ``pdflow.spec_decode.load_drafter``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from eval_target import generate
from torch.utils.data import DataLoader
from train_target import DocStream, lr_at
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdflow.bench.tasks import arith_eval_set
from pdflow.graph import build_graph
from pdflow.model.config import DecoderConfig
from pdflow.model.paths import resolve_model_path
from pdflow.spec.load import compose_spec
from pdflow.spec_decode import AcceptanceStats, build_drafter, drafter_config_for, load_drafter, save_drafter

KINDS = ("dspark", "eagle", "eagle3")
ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--target", default="pdflow:assets/tiny")
    ap.add_argument("--model-config", default="tiny", help="conf/model choice describing the target")
    ap.add_argument("--out-root", default=str(ROOT / "pdflow" / "assets"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=0, help="0: fit --time-budget-s after calibrating")
    ap.add_argument("--time-budget-s", type=float, default=420.0,
                    help="training wall clock per drafter (one kind + eval fits a 10-minute command)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--retrieval-fraction", type=float, default=0.2)
    ap.add_argument("--anchors", type=int, default=64, help="dspark blocks trained per row")
    ap.add_argument("--position-decay", type=float, default=0.8, help="loss weight of draft position j: d**j")
    ap.add_argument("--eval-n", type=int, default=200, help="held-out arithmetic problems")
    ap.add_argument("--eval-k", type=int, default=7, help="draft tokens per step at eval")
    ap.add_argument("--eval-max-new-tokens", type=int, default=320)
    ap.add_argument("--workers", type=int, default=-1, help="data loader processes (-1: 6, smoke 0)")
    ap.add_argument("--calibrate-steps", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--smoke", action="store_true", help="CPU pipeline check: short rows, tiny eval")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seq_len, args.batch_size, args.warmup, args.anchors = 128, 2, 1, 8
        args.steps = args.steps or 5
        args.eval_n, args.eval_max_new_tokens, args.log_every = 2, 24, 1
    if not args.steps and args.time_budget_s <= 0:
        ap.error("--steps 0 sizes the run from --time-budget-s, which must then be > 0")
    if args.workers < 0:
        args.workers = 0 if args.smoke else 6
    return args


class Target:
    """The frozen HF target with forward hooks on the layers drafters tap."""

    def __init__(self, path: str, device: torch.device):
        self.folder = resolve_model_path(path)
        self.config = DecoderConfig.from_file(self.folder)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.folder, dtype=torch.float32, attn_implementation="sdpa").to(device).eval().requires_grad_(False)
        self.tok = AutoTokenizer.from_pretrained(self.folder)
        self.tok.padding_side = "left"
        self._seen: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.model.layers):
            layer.register_forward_hook(self._hook(i))
        self.model.model.norm.register_forward_hook(self._hook(-1))

    def _hook(self, key: int):
        def keep(_module, _inputs, output):
            self._seen[key] = output[0] if isinstance(output, tuple) else output
        return keep

    @torch.no_grad()
    def run(self, ids: torch.Tensor, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [N, T, F], argmax [N, T]): the taps side by side, or the final normed
        hidden state when ``taps`` is empty; fp32 as the engine computes them."""
        self._seen.clear()
        logits = self.model(input_ids=ids).logits
        parts = [self._seen[t] for t in taps] if taps else [self._seen[-1]]
        return torch.cat(parts, dim=-1).float(), logits.argmax(-1)

    def embed_and_head(self):
        return self.model.model.embed_tokens, self.model.lm_head


def run_graph(kind: str, model_choice: str):
    return build_graph(compose_spec([f"model={model_choice}", f"drafter={kind}", "prefill=tp1", "decode=tp1",
                                     "tracking=off"]))


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor):
    """Mean CE over valid entries, each weighted (``weights`` broadcasts to ``labels``)."""
    ce = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    w = valid.float() * weights
    return (ce * w).sum() / w.sum().clamp(min=1e-6)


def dspark_loss(drafter, feats, ids, argmax, ok, args, gen):
    """Random anchors per row; block (anchor p) position j learns the target's argmax at
    p + j (its prediction for token p + j + 1)."""
    n, t = ids.shape
    k = drafter.config.num_speculative_tokens
    weights = ok[:, 1:t - 1].float().cpu() + 1e-9  # drawn on the host: the generator lives there
    anchors = torch.multinomial(weights, args.anchors, replacement=True, generator=gen).to(ids.device) + 1
    logits = drafter.dense_logits(feats, ids, anchors, k)
    pos = anchors[..., None] + torch.arange(k, device=ids.device)
    inside = pos < t
    pos = pos.clamp(max=t - 1)
    labels = argmax.gather(1, pos.flatten(1)).view_as(pos)
    valid = inside & ok.gather(1, pos.flatten(1)).view_as(pos)
    decay = args.position_decay ** torch.arange(k, device=ids.device, dtype=torch.float32)
    return weighted_ce(logits, labels, valid, decay[None, None, :]), logits.argmax(-1).eq(labels)[valid].float().mean()


def chain_loss(drafter, feats, ids, argmax, ok, args, gen):
    """Every entry starts a chain of ``steps``; step j at entry t learns argmax[t + 1 + j]."""
    steps = drafter.config.num_speculative_tokens
    n, t = ids.shape
    logits = drafter.dense_logits(feats, ids, steps)  # [N, steps, T-1, V]
    pos = torch.arange(t - 1, device=ids.device)[None, :] + 1 + torch.arange(steps, device=ids.device)[:, None]
    inside = pos < t
    pos = pos.clamp(max=t - 1)
    labels = argmax[:, pos]  # [N, steps, T-1]
    valid = inside[None] & ok[:, pos]
    decay = args.position_decay ** torch.arange(steps, device=ids.device, dtype=torch.float32)
    loss = weighted_ce(logits, labels, valid, decay[None, :, None])
    return loss, logits.argmax(-1).eq(labels)[valid].float().mean()


def drafts_for(drafter, feats, ids, start: int, k: int) -> torch.Tensor:
    """[T, k] drafts the serving loop would propose at each anchor position p >= start."""
    t = ids.shape[1]
    if drafter.kind == "dspark":
        anchors = torch.arange(start, t, device=ids.device)[None]
        return drafter.dense_logits(feats, ids, anchors, k)[0].argmax(-1)
    # chain from anchor p starts at entry p - 1
    return drafter.dense_logits(feats, ids, k)[0].argmax(-1).T[start - 1:]


@torch.no_grad()
def evaluate(drafter, target: Target, taps, args, device) -> dict:
    """Replay the target's greedy continuations of held-out problems through the serving
    loop's arithmetic: tokens per forward and acceptance at k = --eval-k."""
    items = arith_eval_set(args.eval_n, seed=1234, k_shot=1 if args.smoke else 5)
    prompts = [it.prompt for it in items]
    outs = generate(target.model, target.tok, prompts, batch_size=64 if device.type == "cuda" else 2,
                    max_new_tokens=args.eval_max_new_tokens, stop="\n\n")
    stats, k = AcceptanceStats(), args.eval_k
    for prompt, out in zip(prompts, outs, strict=True):
        n_prompt = len(target.tok(prompt)["input_ids"])
        ids = target.tok(prompt + out, return_tensors="pt")["input_ids"].to(device)
        total = ids.shape[1]
        if total <= n_prompt + 1:
            continue
        feats, _ = target.run(ids, taps)
        drafts = drafts_for(drafter, feats, ids, n_prompt, k)
        p = n_prompt  # the anchor: the token the prefill sampled
        while p < total - 1:
            offered = min(k, total - 1 - p)
            truth = ids[0, p + 1:p + 1 + offered]
            match = (drafts[p - n_prompt, :offered] == truth).long().cumprod(0)
            accepted = int(match.sum())
            stats.record(offered, accepted)
            p += accepted + 1
    return {"problems": len(items), "k": k, "acceptance_rate": round(stats.acceptance_rate, 4),
            "tokens_per_forward": round(stats.tokens_per_forward, 3),
            "rate_at": [round(r, 4) for r in stats.rate_at], "verify_steps": stats.verify_steps,
            "proposed": stats.proposed, "accepted": stats.accepted}


def train_one(kind: str, target: Target, args, device: torch.device) -> dict:
    torch.manual_seed(args.seed)
    cuda = device.type == "cuda"
    graph = run_graph(kind, args.model_config)
    cfg = drafter_config_for(graph, target.config)
    units = graph.rank("decode", 0).units
    drafter = build_drafter(cfg, units, device=device)
    for name, p in drafter.named_parameters():  # small normal init, unit norms, zero mask
        with torch.no_grad():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    drafter.bind_target(*target.embed_and_head())
    taps = drafter.tap_layers
    loss_fn = dspark_loss if kind == "dspark" else chain_loss
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay, fused=cuda)
    loader = DataLoader(DocStream(args.seed + 1, args.seq_len, args.retrieval_fraction),
                        batch_size=args.batch_size, num_workers=args.workers, pin_memory=cuda,
                        prefetch_factor=8 if args.workers else None)
    it, gen = iter(loader), torch.Generator().manual_seed(args.seed)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"[{kind}] params {n_params / 1e6:.2f}M taps {list(taps) or 'last hidden'} device {device}", flush=True)
    total = args.steps or 10**9
    calib_from, t_calib0, step, t_loop = args.calibrate_steps // 3, None, 0, time.time()
    drafter.train()
    while step < total:
        x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        ok = torch.cat([y[:, 1:] != -100, torch.zeros_like(y[:, :1], dtype=torch.bool)], 1)
        feats, argmax = target.run(x, taps)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss, acc = loss_fn(drafter, feats, x, argmax, ok, args, gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if not args.steps and step in (calib_from, args.calibrate_steps):
            if cuda:
                torch.cuda.synchronize()
            if step == calib_from:
                t_calib0 = time.time()
            else:
                per_step = (time.time() - t_calib0) / (args.calibrate_steps - calib_from)
                total = step + max(1, int(0.97 * (args.time_budget_s - (time.time() - t_loop)) / per_step))
                print(f"[{kind}] calibrated {per_step * 1e3:.1f} ms/step -> {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            print(f"[{kind}] step {step}/{total} loss {loss.item():.4f} draft acc {acc.item():.3f} "
                  f"elapsed {time.time() - t_loop:.0f}s", flush=True)
        if args.time_budget_s > 0 and not args.smoke and time.time() - t_loop > args.time_budget_s:
            break
    train_s = time.time() - t_loop
    out = Path(args.out_root) / f"{target.folder.name}-{kind}"
    cfg.extra = {"target": args.target, "trained_steps": step}
    save_drafter(drafter.eval(), out, dtype=torch.bfloat16)
    shipped = load_drafter(out, units, device=device)  # evaluate what ships (bf16 -> fp32)
    shipped.bind_target(*target.embed_and_head())
    t_eval = time.time()
    result = evaluate(shipped, target, taps, args, device)
    record = {
        "kind": kind, "target": args.target, "taps": list(taps), "params": n_params, "steps": step,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr, "anchors": args.anchors,
        "position_decay": args.position_decay, "retrieval_fraction": args.retrieval_fraction,
        "final_loss": round(loss.item(), 4), "train_seconds": round(train_s, 1),
        "eval_seconds": round(time.time() - t_eval, 1), "eval": result, "smoke": args.smoke,
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "reproduce": f"python scripts/train_drafter.py --kinds {kind} --seed {args.seed} --steps {step} "
                     f"--time-budget-s 0 --seq-len {args.seq_len} --batch-size {args.batch_size} "
                     f"--lr {args.lr} --workers {args.workers}",
    }
    (out / "pdflow_training.json").write_text(json.dumps(record, indent=2) + "\n")
    write_card(out, record, cfg)
    print(f"[{kind}] saved {out}: acceptance {result['acceptance_rate']:.3f}, tokens/forward "
          f"{result['tokens_per_forward']:.2f} at k={result['k']} over {result['problems']} problems", flush=True)
    return record


def write_card(out: Path, record: dict, cfg) -> None:
    ev = record["eval"]
    lines = [
        f"# pdflow {out.name}: a {record['kind']} drafter for `{record['target']}`", "",
        f"Trained by `scripts/train_drafter.py` in {record['train_seconds']} s on {record['device']} "
        f"({record['steps']} steps of {record['batch_size']} x {record['seq_len']} tokens; final loss "
        f"{record['final_loss']}){' - SMOKE RUN, not a trained drafter' if record['smoke'] else ''}.", "",
        "| | |", "|---|---|",
        f"| kind | {record['kind']} ({cfg.num_layers} layer(s), {cfg.num_heads} q / {cfg.num_kv_heads} KV heads, "
        f"head_dim {cfg.head_dim}) |",
        f"| reads | {('target layers ' + str(record['taps'])) if record['taps'] else 'target final hidden state'} |",
        f"| parameters | {record['params']:,} (embedding and LM head shared with the target) |",
        f"| held-out arithmetic, greedy, k={ev['k']} | acceptance **{ev['acceptance_rate']:.3f}**, tokens per "
        f"forward **{ev['tokens_per_forward']:.2f}** ({ev['problems']} problems, {ev['verify_steps']} steps) |",
        f"| steps accepting draft i (of those offering it), i = 1..{ev['k']} | "
        f"{', '.join(f'{r:.2f}' for r in ev['rate_at'])} |", "",
        "Acceptance is measured by replaying the target's greedy continuations through the serving",
        "loop's arithmetic with the saved weights; reproduce with the `reproduce` line of",
        "`pdflow_training.json`. Load with `pdflow.spec_decode.load_drafter(path, units)`.", "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto"
                          else args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # features as the fp32 engine computes them
    target = Target(args.target, device)
    records = [train_one(kind, target, args, device) for kind in args.kinds]
    for r in records:
        ev = r["eval"]
        print(f"{r['kind']:7s} acceptance {ev['acceptance_rate']:.3f} tokens/forward {ev['tokens_per_forward']:.2f} "
              f"(k={ev['k']}, {ev['problems']} problems) train {r['train_seconds']}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
