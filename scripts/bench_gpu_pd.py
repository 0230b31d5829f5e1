#!/usr/bin/env python
"""P/D on GPUs (issue 16), one table per call, through ``pdflow.compose`` + ``Deployment``.

``--table pd``: P/D (PP2 prefill -> TP2 decode) vs monolithic TP2 under one fixed mixed
load: decode-heavy background requests (short prompt, long output) with long prompts
arriving at a fixed interval once every background request is decoding. Greedy outputs
compared request by request; TTFT and inter-token latency percentiles and output tokens/s
per mode, and P/D / monolithic ratios. ``Deployment`` steps its two instances from one
thread, one after the other, so a P/D decode step waits for any prefill step before it:
this table measures that driver, not two instances stepping concurrently.

``--table prefill-cost``: prefill only (max_tokens 1), random ``--prompt-len`` prompts
kept ``--concurrency`` in flight over ``--requests``, for PP2 vs TP2 prefill (decode TP2),
drafter off/on, and PP2 with an uneven (lighter last stage) partition: prompt tokens/s,
mean TTFT, KV blocks of the prefill instance (per request, as its block manager counts
them, and its pool, as the graph sized it); ratios against TP2 drafter-off of this run.

``--table transfer`` runs ``scripts/bench_gpu_transfer.py`` (one request's head-cut KV
through ``transfer=nccl`` against one NCCL send of the same bytes).

``--gpus 4`` runs the same tables at PP4 / TP4 (the reference deployment's layout), unchanged
otherwise. On CUDA both instances of a P/D pair sit on GPUs 0..n-1 (``device_offset=0`` on each side:
separate process groups sharing the devices), each sized to ``--memory`` of a device.
One untimed pass of every deployment runs before its timed one.

    python scripts/bench_gpu_pd.py --table pd --device cuda --shape qwen3-0.6b          # 2x H200
    python scripts/bench_gpu_pd.py --table prefill-cost --device cuda --shape qwen3-0.6b
    python scripts/bench_gpu_pd.py --table pd --device cpu --shape tiny                 # CPU smoke
    python scripts/bench_gpu_pd.py --table prefill-cost --device cpu --shape tiny --prompt-len 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
SHAPES = ("tiny", "qwen3-0.6b", "llama3-8b")


def prefill_layouts(n: int) -> dict[str, list[str]]:
    """Table 3's prefill layouts on ``n`` GPUs: name -> overrides (the decode side is TPn)."""
    return {f"tp{n}": [f"prefill=tp{n}"], f"pp{n}": [f"prefill=pp{n}"],
            f"pp{n}-uneven": [f"prefill=pp{n}", "prefill.partition=lighter_last"]}


def default_rows(n: int) -> str:
    return f"tp{n}:none,tp{n}:dspark,pp{n}:none,pp{n}:dspark,pp{n}-uneven:dspark"


def pd_modes(n: int) -> dict[str, list[str]]:
    return {f"P/D PP{n}->TP{n}": [f"prefill=pp{n}", f"decode=tp{n}"],
            f"monolithic TP{n}": ["mode=monolithic", f"prefill=pp{n}", f"decode=tp{n}"]}

# Per device: the workload sizes a flag leaves unset.
DEFAULTS = {
    "cuda": dict(prompt_len=8192, requests=32, concurrency=16, bg_requests=32, bg_prompt_len=64,
                 bg_output_len=512, long_requests=8, long_prompt_len=8192, long_output_len=16,
                 long_interval=0.5),
    "cpu": dict(prompt_len=256, requests=16, concurrency=16, bg_requests=4, bg_prompt_len=16,
                bg_output_len=24, long_requests=2, long_prompt_len=384, long_output_len=4,
                long_interval=0.5),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", required=True, choices=["pd", "prefill-cost", "transfer"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default=None, help=f"one of {SHAPES} (random init but tiny: the shipped model)")
    p.add_argument("--model", help="HF checkpoint folder instead of --shape")
    p.add_argument("--transfer", help="transfer config (default: nccl on cuda, mooncake_tcp on cpu)")
    p.add_argument("--memory", type=float, default=0.35, help="share of one GPU per instance (cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpus", type=int, default=2, choices=[2, 4],
                   help="PPn/TPn on GPUs 0..n-1 (4: the reference deployment's PP4 -> TP4)")
    p.add_argument("--out", help="folder: the table (markdown) and the raw numbers (JSON)")
    p.add_argument("--mlflow", help="MLflow tracking URI: the table as a parent run, a child per row")
    g = p.add_argument_group("table pd")
    g.add_argument("--drafter", default="none", help="drafter of both modes")
    for name in ("bg_requests", "bg_prompt_len", "bg_output_len", "long_requests", "long_prompt_len",
                 "long_output_len"):
        g.add_argument("--" + name.replace("_", "-"), type=int)
    g.add_argument("--long-interval", type=float, help="seconds between long-prompt arrivals")
    g = p.add_argument_group("table prefill-cost")
    g.add_argument("--rows", help="layout:drafter,... (default: " + default_rows(2) + " at --gpus 2)")
    g.add_argument("--prompt-len", type=int)
    g.add_argument("--requests", type=int)
    g.add_argument("--concurrency", type=int)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every deployment")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shape = args.shape or ("qwen3-0.6b" if args.device == "cuda" else "tiny")
    if args.shape not in SHAPES and not args.model:
        p.error(f"unknown shape {args.shape!r}; choose from {SHAPES} or pass --model")
    args.transfer = args.transfer or ("nccl" if args.device == "cuda" else "mooncake_tcp")
    args.requests = max(args.requests, 1)
    return args


# -- specs -------------------------------------------------------------------------------


@contextlib.contextmanager
def model_overrides(args):
    """Overrides naming the model: the shipped tiny model, a checkpoint folder, or a
    random-init checkpoint of the shape (bench_engine's writer) in a temporary folder."""
    if args.model:
        yield ["model=hf", f"model.path={args.model}"]
    elif args.shape == "tiny":
        yield ["model=tiny"]
    else:
        import torch

        sys.path.insert(0, str(SCRIPTS))
        from bench_engine import write_checkpoint

        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(Path(tmp), args.shape, "cpu", dtype, args.seed)
            yield ["model=hf", f"model.path={tmp}"]


def device_overrides(args) -> list[str]:
    out = ["tracking=off", f"transfer={args.transfer}", f"seed={args.seed}"]
    for side in ("prefill", "decode"):
        out.append(f"{side}.device={args.device}")
        if args.device == "cuda":
            import torch

            gib = torch.cuda.get_device_properties(0).total_memory / (1 << 30)
            # Both instances on GPUs 0-1: the graph would otherwise put the decode after
            # the prefill's ranks (GPUs 2-3).
            out += [f"{side}.device_offset=0", f"{side}.device_memory_gib={gib:.1f}",
                    f"{side}.memory={args.memory}"]
    return out


def open_deployment(overrides: list[str]):
    from pdflow import Deployment, compose

    return Deployment(compose(overrides))


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    high = max(5, int(vocab * 0.9))  # below the top tenth, where checkpoints keep added specials
    return [[rng.randrange(4, high) for _ in range(length)] for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# -- table 2: P/D vs monolithic under a mixed load ---------------------------------------


def drive_mixed(d, bg_prompts, long_prompts, args) -> dict:
    """Background requests at t=0; long prompt j arrives ``j * long_interval`` after every
    background request has its first token. Token times are taken as ``run`` yields them;
    TTFT counts from a request's scheduled arrival."""
    from pdflow import SamplingParams

    bg_params = SamplingParams(temperature=0, max_tokens=args.bg_output_len, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_tokens=args.long_output_len, ignore_eos=True)
    start = time.perf_counter()
    bg_ids = d.submit(bg_prompts, bg_params)
    arrival = {rid: start for rid in bg_ids}
    long_ids: list[str] = []
    times: dict[str, list[float]] = {rid: [] for rid in bg_ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in bg_ids}
    errors: list[str] = []
    anchor = None

    def submit_due(now: float) -> None:
        while len(long_ids) < len(long_prompts) and now >= anchor + len(long_ids) * args.long_interval:
            rid = d.submit([long_prompts[len(long_ids)]], long_params)[0]
            arrival[rid] = anchor + len(long_ids) * args.long_interval
            times[rid], tokens[rid] = [], []
            long_ids.append(rid)

    while True:
        for out in d.run():
            now = time.perf_counter()
            if out.error:
                errors.append(f"{out.request_id}: {out.error}")
            elif out.index >= 0:
                times[out.request_id].append(now)
                tokens[out.request_id].append(out.token_id)
            if anchor is None and all(times[r] for r in bg_ids):
                anchor = now
            if anchor is not None:
                submit_due(now)
        if len(long_ids) == len(long_prompts):
            break
        anchor = anchor if anchor is not None else time.perf_counter()
        time.sleep(max(0.0, anchor + len(long_ids) * args.long_interval - time.perf_counter()))
        submit_due(time.perf_counter())
    ends = [t[-1] for t in times.values() if t]
    order = bg_ids + long_ids
    ttft = {rid: times[rid][0] - arrival[rid] for rid in order if times[rid]}
    itl = [b - a for rid in order for a, b in zip(times[rid], times[rid][1:], strict=False)]
    n_tokens = sum(len(t) for t in tokens.values())
    return dict(
        tokens=[tokens[rid] for rid in order], errors=errors,
        ttft_p50_s=percentile(list(ttft.values()), 0.5), ttft_p99_s=percentile(list(ttft.values()), 0.99),
        long_ttft_p50_s=percentile([ttft[r] for r in long_ids if r in ttft], 0.5),
        long_ttft_p99_s=percentile([ttft[r] for r in long_ids if r in ttft], 0.99),
        itl_p50_s=percentile(itl, 0.5), itl_p99_s=percentile(itl, 0.99),
        output_tok_s=n_tokens / (max(ends) - start) if ends else 0.0, output_tokens=n_tokens,
        wall_s=(max(ends) - start) if ends else 0.0,
    )


def run_mode(base: list[str], mode_overrides: list[str], args) -> dict:
    from pdflow import SamplingParams

    with open_deployment([*base, *mode_overrides]) as d:
        vocab = d.vocab_size
        warm_bg = random_prompts(2, args.bg_prompt_len, vocab, args.seed + 1000)
        warm_long = random_prompts(1, args.long_prompt_len, vocab, args.seed + 1001)
        d.generate(warm_bg + warm_long, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        bg = random_prompts(args.bg_requests, args.bg_prompt_len, vocab, args.seed)
        long = random_prompts(args.long_requests, args.long_prompt_len, vocab, args.seed + 1)
        result = drive_mixed(d, bg, long, args)
        result["free_kv_blocks_after"] = d.free_kv_blocks()
    return result


PD_METRICS = (("TTFT p50 ms", "ttft_p50_s", 1e3), ("TTFT p99 ms", "ttft_p99_s", 1e3),
              ("long TTFT p50 ms", "long_ttft_p50_s", 1e3), ("long TTFT p99 ms", "long_ttft_p99_s", 1e3),
              ("ITL p50 ms", "itl_p50_s", 1e3), ("ITL p99 ms", "itl_p99_s", 1e3),
              ("output tok/s", "output_tok_s", 1.0))


def pd_table(args, model: list[str]) -> tuple[str, dict]:
    base = [*model, *device_overrides(args), f"drafter={args.drafter}", *args.overrides]
    results = {}
    for name, mode in pd_modes(args.gpus).items():
        results[name] = soft(lambda mode=mode: run_mode(base, mode, args))
    pd, mono = results.values()
    lines = [f"load: {args.bg_requests} background requests ({args.bg_prompt_len}-token prompt, "
             f"{args.bg_output_len} tokens out) + {args.long_requests} long prompts ({args.long_prompt_len} "
             f"tokens, {args.long_output_len} out) every {args.long_interval} s once all background "
             f"requests decode; greedy, EOS ignored, drafter={args.drafter}"]
    if "error" not in pd and "error" not in mono:
        differ = sum(a != b for a, b in zip(pd["tokens"], mono["tokens"], strict=True))
        lines.append(f"greedy outputs identical P/D vs monolithic: {'yes' if not differ else 'no'} "
                     f"({differ} of {len(pd['tokens'])} requests differ)")
    lines += ["", "| mode | " + " | ".join(m[0] for m in PD_METRICS) + " | errors |",
              "|---|" + "---|" * (len(PD_METRICS) + 1)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | FAILED: {r['error']} |" + " |" * len(PD_METRICS))
            continue
        cells = [f"{r[key] * scale:.1f}" for _, key, scale in PD_METRICS]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {len(r['errors'])} |")
    if "error" not in pd and "error" not in mono:
        ratios = [f"{pd[key] / mono[key]:.2f}x" if mono[key] else "-" for _, key, _ in PD_METRICS]
        lines.append("| P/D / monolithic | " + " | ".join(ratios) + " | |")
    raw = {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in results.items()}
    return "\n".join(lines), raw


# -- table 3: prefill cost ---------------------------------------------------------------


def prefill_cost(overrides: list[str], *, prompt_len: int, requests: int, concurrency: int, seed: int) -> dict:
    """One layout: ``requests`` random prompts, ``concurrency`` in flight, one output token
    each, after an untimed pass of the same shape (distinct prompts: no prefix hits)."""
    from pdflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with open_deployment(overrides) as d:
        producer = d.producer
        vocab = d.vocab_size
        d.generate(random_prompts(min(2, requests), prompt_len, vocab, seed + 1000), params)
        prompts = random_prompts(requests, prompt_len, vocab, seed)
        start = time.perf_counter()
        submitted: dict[str, float] = {}
        ttft: dict[str, float] = {}
        errors: list[str] = []

        def submit_next() -> None:
            rid = d.submit([prompts[len(submitted)]], params)[0]
            submitted[rid] = time.perf_counter()

        while len(submitted) < min(concurrency, requests):
            submit_next()
        for out in d.run():
            now = time.perf_counter()
            if out.error:
                errors.append(out.error)
            elif out.request_id not in ttft:
                ttft[out.request_id] = now - submitted[out.request_id]
            if out.finished and len(submitted) < requests:
                submit_next()
        wall = time.perf_counter() - start
        leaked = {role: e.num_kv_blocks - d.free_kv_blocks()[role]
                  for role, e in (("prefill", d.producer), ("decode", d.consumer))}
        budget = producer.graph.budgets["prefill"]
        blocks = producer.blocks.blocks_for(prompt_len)
        block_bytes = sum(s.bytes_per_block for s in budget.stages) * producer.parallel.tp
        return dict(
            prompt_tok_s=prompt_len * len(ttft) / wall, ttft_mean_s=statistics.fmean(ttft.values()) if ttft else 0.0,
            blocks_per_request=blocks, kv_mib_per_request=blocks * block_bytes / (1 << 20),
            pool_blocks=producer.num_kv_blocks, completed=len(ttft), errors=errors[:3], wall_s=wall,
            blocks_held_after=leaked, partition=[s.layer_stop - s.layer_start for s in producer.graph.producer.stages],
        )


def prefill_cost_rows(args, model: list[str]) -> list[dict]:
    """Every ``--rows`` entry (the TP2 drafter-off baseline first), measured in this
    process one after another; ratios against the baseline."""
    baseline, layouts = f"tp{args.gpus}:none", prefill_layouts(args.gpus)
    wanted = [r.strip() for r in (args.rows or default_rows(args.gpus)).split(",") if r.strip()]
    rows = [baseline] + [r for r in wanted if r != baseline]
    base = [*model, *device_overrides(args), f"decode=tp{args.gpus}", *args.overrides]
    out = []
    for row in rows:
        layout, _, drafter = row.partition(":")
        if layout not in layouts:
            raise SystemExit(f"unknown prefill layout {layout!r}; choose from {sorted(layouts)}")
        overrides = [*base, *layouts[layout], f"drafter={drafter or 'none'}"]
        res = soft(lambda o=overrides: prefill_cost(o, prompt_len=args.prompt_len, requests=args.requests,
                                                      concurrency=args.concurrency, seed=args.seed))
        out.append(dict(res, layout=layout, drafter=drafter or "none"))
    ref = out[0]
    for r in out:
        if "error" not in r and "error" not in ref:
            r["tok_s_ratio"] = r["prompt_tok_s"] / ref["prompt_tok_s"]
            r["ttft_ratio"] = r["ttft_mean_s"] / ref["ttft_mean_s"]
    return out


def prefill_cost_table(args, model: list[str]) -> tuple[str, list[dict]]:
    rows = prefill_cost_rows(args, model)
    lines = [f"prefill only: {args.requests} random {args.prompt_len}-token prompts, "
             f"{min(args.concurrency, args.requests)} in flight, max_tokens 1, decode TP{args.gpus}; ratios "
             f"against tp{args.gpus}:none of this run; KV blocks of the prefill instance (its block manager's count per "
             "request, the graph's bytes per block on all its ranks, its pool)", "",
             f"| prefill | drafter | partition | prompt tok/s | x tp{args.gpus}:none | mean TTFT ms | "
             f"x tp{args.gpus}:none | "
             "KV blocks/request | KV MiB/request | pool blocks | completed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['drafter']} | FAILED: {r['error']} |" + " |" * 8)
            continue
        lines.append(
            f"| {r['layout']} | {r['drafter']} | {r['partition']} | {r['prompt_tok_s']:,.0f} | "
            f"{r.get('tok_s_ratio', float('nan')):.2f}x | {r['ttft_mean_s'] * 1e3:.1f} | "
            f"{r.get('ttft_ratio', float('nan')):.2f}x | {r['blocks_per_request']} | {r['kv_mib_per_request']:.1f} | "
            f"{r['pool_blocks']} | {r['completed']}/{args.requests} |")
    return "\n".join(lines), rows


# -- output ------------------------------------------------------------------------------


def soft(fn) -> dict:
    """One measurement; its failure (a refusal, a crash) becomes the row's error."""
    from pdflow.graph import GraphRefused

    try:
        return fn()
    except GraphRefused as err:
        return dict(error="refused: " + ", ".join(sorted(r.code.value for r in err.refusals)))
    except Exception as err:  # one row fails, the table goes on
        traceback.print_exc()
        return dict(error=f"{type(err).__name__}: {str(err)[:160]}")


def hardware(device: str) -> str:
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name(0)}" if n else "cuda (no device visible)"
    import os

    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def command_line(argv) -> str:
    """The command that reproduces this run, as the results say it."""
    return "python " + shlex.join([f"scripts/{Path(sys.argv[0]).name}", *(argv or sys.argv[1:])])


def publish(args, *, name: str, title: str, command: str, text: str, results, rows: list[dict],
            name_of=None) -> None:
    """A table out: printed, written to ``--out`` (``name``.md and the raw numbers as
    ``name``.json) and logged to ``--mlflow`` (a parent run ``title``, a child per row)."""
    from bench_engine import git_commit

    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.md").write_text(text)
        (folder / f"{name}.json").write_text(json.dumps(
            dict(table=name, command=command, hardware=hardware(args.device), commit=git_commit(),
                 args=vars(args), results=results), indent=2, default=str))
    print("\n" + text, flush=True)
    if args.mlflow:
        from bench_mlflow import log_table

        log_table(args.mlflow, experiment="pdflow-bench", table=title, text=text, rows=rows,
                  tags={"pdflow.bench.command": command, "pdflow.bench.hardware": hardware(args.device)},
                  **({"name_of": name_of} if name_of else {}))


def main(argv=None) -> int:
    from bench_engine import git_commit  # scripts/ sits beside this file

    args = parse_args(argv)
    if args.table == "transfer":  # three processes of its own: a script of its own
        run = [sys.executable, str(SCRIPTS / "bench_gpu_transfer.py")]
        if args.device == "cpu":
            run += ["--device", "cpu", "--model", "tiny", "--tokens", "256", "--pages", "16"]
        return subprocess.run(run, check=False).returncode
    with model_overrides(args) as model:
        if args.table == "pd":
            table, raw = pd_table(args, model)
        else:
            table, raw = prefill_cost_table(args, model)
    command = command_line(argv)
    header = (f"bench_gpu_pd --table {args.table} on {hardware(args.device)}, commit {git_commit()}, "
              f"model {args.model or args.shape}, transfer={args.transfer}\ncommand: {command}")
    text = f"{header}\n\n{table}\n"
    rows = [dict(r, name=n) for n, r in raw.items()] if isinstance(raw, dict) else raw
    publish(args, name=args.table, title=f"{args.table} ({args.gpus} GPUs)", command=command, text=text,
            results=raw, rows=rows, name_of=lambda r: r.get("name") or f"{r.get('layout')}:{r.get('drafter')}")
    failed = any("error" in r for r in (raw.values() if isinstance(raw, dict) else raw))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
