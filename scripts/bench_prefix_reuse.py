#!/usr/bin/env python
"""P/D prefix reuse at ~80% reuse vs reuse off, and prefix-aware vs round-robin routing.

``--mode separate`` (default, CPU): one prefill and two (``--decodes``) decode instances, each its own
``pdflow serve`` process, behind a router; ``workload=multiturn`` (conversations whose
later turns repeat ``--reuse`` of their prompt: the turn before and its answer, sent once
that answer is back, as a chat client does; ``--open-loop``: the turn before alone, every
turn built ahead) driven over HTTP. Phases, each with two
fresh decode instances and a seed of its own (the one prefill instance's cache then never
holds a phase's prompts ahead of it):

  off       router.prefix_reuse=false (every prompt's whole KV moves), router.policy=prefix
  on        decode-side reuse (only the uncached suffix moves), router.policy=prefix
  on+local  reuse, and suffixes below --local tokens prefilled on the decode instance
  rr        reuse, router.policy=round_robin (the on phase's instances, another seed)
  none      no prefix cache anywhere (both sides' enable_prefix_caching=false, a prefill
            instance of its own): what "off" would be if the prefill side did not reuse
            its own cached prefix for the compute

Prints prompt KV bytes sent (the prefill instance's ``pdflow_kv_sent_bytes_total``), TTFT
p50, the decode instances' cache hit rate (usage cached_tokens / prompt tokens), the prefill
instance's (its ``pdflow_prefix_cache_hit_tokens_total`` / prompt tokens), and
the ratios: bytes on/off (goal <= 0.3x), TTFT p50 on/off (goal <= 0.5x), hit rate
prefix/rr (goal >= 1.5x).

Many users (the acceptance's run: the decode pools hold the conversations, the prefill
instance's does not; users think between turns, so rounds do not cycle in LRU's eviction
order), about 6 minutes:

    python scripts/bench_prefix_reuse.py --phases off,on,on+local,rr --local 100 \
        --conversations 90 --think 2 --check

``--mode deployment``: P/D in one process (``pdflow.Deployment``), the conversations one
request at a time, TTFT from ``Deployment.stream``; reuse on vs off at --reuse, and a
workload with no reuse. The GPU figure:

    python scripts/bench_prefix_reuse.py --mode deployment --prompt-tokens 1024 --conversations 8 \\
        --set model=qwen3-0.6b model.path=null prefill.device=cuda decode.device=cuda \\
        prefill.device_offset=0 decode.device_offset=0 prefill.device_memory_gib=140 \\
        decode.device_memory_gib=140 prefill.memory=0.3 decode.memory=0.3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

BASE = ["drafter=none", "tracking=off", "prefill=tp1", "decode=tp1", "prefill.block_size=16",
        "decode.block_size=16", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16"]
# The prefill instance's prefix-cache hits: over a phase's prompt tokens, how much of them it
# did not compute (a remote prefill computes from its own cached prefix, reuse on or off).
PRODUCER_HITS = "pdflow_prefix_cache_hit_tokens_total"
PROMPTS = "pdflow_prefills_total"  # a decode instance's prompts, prefilled there or remotely
URL = re.compile(r" at (http://127\.0\.0\.1:\d+)/v1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("separate", "deployment"), default="separate")
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=128, help="the first turn's prompt")
    p.add_argument("--reuse", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--local", type=int, default=64, help="router.local_prefill_tokens of the on+local phase")
    p.add_argument("--decodes", type=int, default=2,
                   help="separate mode: decode instances (the acceptance's 2; with more, round robin "
                        "lands on the instance holding a conversation's last turn less often)")
    p.add_argument("--phases", default="off,on,on+local,rr,none", help="separate mode: which phases to run")
    p.add_argument("--repeat", type=int, default=1,
                   help="separate mode: run the phases this many times (fresh instances each time, the same "
                        "prompts), print each repeat's ratios, then the ratios of the p50s over every repeat's "
                        "requests pooled (a 30-request p50 on a busy 2-core machine swings by +-8%%)")
    p.add_argument("--think", type=float, default=0.0,
                   help="the workload's think_time_s: a user's mean seconds between an answer and the next turn "
                        "(exponential). 0: the conversations in lockstep, each round in the order the last one "
                        "ended, which is the order an LRU pool evicts in (under pool pressure each prefix goes "
                        "just before its next turn), and round robin's placement follows that order")
    p.add_argument("--system-prompt", type=int, default=0,
                   help="the workload's system_prompt_tokens: tokens every conversation's first turn starts with "
                        "(the hit-rate bounds printed leave them out)")
    p.add_argument("--open-loop", action="store_true",
                   help="the workload's fold_answers=false: every turn built ahead, the answers left out of "
                        "the next turn (the shape of this bench's figures before answers were folded in)")
    p.add_argument("--check", action="store_true",
                   help="separate mode, closed loop: after each phase, generate every prompt it sent with the "
                        "decode side in this process (the same spec, greedy) and count the answers that differ "
                        "from what the instances served: the one-process oracle at this scale, with eviction, "
                        "reuse, local and remote prefill all under way")
    p.add_argument("--dump", default=None, help="separate mode: write each phase's request rows (turn, TTFT, "
                   "cached tokens, ...) to DIR/<phase>_<repeat>.json")
    p.add_argument("--set", nargs="*", default=[], help="more spec overrides (every instance and the router)")
    args = p.parse_args()
    if args.check and (args.open_loop or args.mode != "separate"):
        p.error("--check needs separate mode and the closed loop (the answers' token ids)")
    return args


# -- separate instances -----------------------------------------------------------------

def base(extra: list[str]) -> list[str]:
    """BASE less the keys ``extra`` sets (Hydra refuses a key given twice)."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [b for b in BASE if b.split("=", 1)[0] not in keys]


def start(role: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MC_LOG_LEVEL": "WARNING"}
    return subprocess.Popen([sys.executable, "-m", "pdflow.cli", "serve", f"role={role}", "serve.port=0",
                             *base(list(extra)), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def url_of(proc: subprocess.Popen, timeout: float = 600) -> str:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if found := URL.search(line):
            return found.group(1)
    raise RuntimeError("no URL from pdflow serve:\n" + "".join(seen[-30:]))


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stdout.close()


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def workload_spec(args, seed: int):
    from pdflow.spec import WorkloadSpec

    return WorkloadSpec(kind="multiturn", num_requests=args.conversations * args.turns,
                        conversations=args.conversations, concurrency=args.concurrency,
                        prompt_tokens=args.prompt_tokens, prefix_reuse=args.reuse, max_tokens=args.max_tokens,
                        seed=seed, progress=False, fold_answers=not args.open_loop,
                        think_time_s=args.think, system_prompt_tokens=args.system_prompt)


def workload_bounds(args, turns: dict) -> tuple[float, float]:
    """The hit rate a perfect router gets and random placement's, over a phase's turns."""
    from pdflow.bench.workloads.multiturn import hit_rate_bounds

    return hit_rate_bounds(turns, args.decodes, 16)


def drive_phase(args, router: str, prefill: str, decode: list[str], seed: int, name: str) -> dict:
    """One phase's workload; ``name``: its rows' file under ``--dump`` (phase and repeat);
    ``decode``: the decode instances, whose prompts are counted each (the routing's balance)."""
    from pdflow.bench.workloads import Target, build_workloads, prepare, run_workloads_sync
    from pdflow.bench.workloads.multiturn import turn_lengths

    spec = workload_spec(args, seed)
    (workload,) = build_workloads(spec, vocab=128)
    answered: list[tuple[list[int], list[int]]] = []
    if args.check:
        workload.follow_up = keeping(workload.follow_up, answered)
    sent = counter(prefill, "pdflow_kv_sent_bytes_total")
    producer_hits = counter(prefill, PRODUCER_HITS)
    prompts = [counter(d, PROMPTS) for d in decode]
    result = run_workloads_sync(Target(url=router, model="tiny"), prepare([workload]), spec)
    rows = [r for r in result.rows if r["ok"]]
    if len(rows) != spec.num_requests:
        raise RuntimeError(f"{spec.num_requests - len(rows)} requests failed: {result.rows[0]}")
    ttfts = [r["ttft_s"] for r in rows]
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        with open(os.path.join(args.dump, f"{name}.json"), "w") as f:
            json.dump(rows, f)
    hits = counter(prefill, PRODUCER_HITS) - producer_hits
    return {"bytes": counter(prefill, "pdflow_kv_sent_bytes_total") - sent, "ttft_p50": statistics.median(ttfts),
            "hit_rate": result.metrics["multiturn_cache_hit_rate"],
            "producer_hit_rate": hits / sum(r["prompt_tokens"] for r in rows),
            "per_decode_instance": [counter(d, PROMPTS) - n for d, n in zip(decode, prompts, strict=True)],
            **({"differ_from_oracle": differing(args, answered)} if args.check else {}),
            "ttfts": ttfts, "turns": turn_lengths(rows, answers_folded=spec.fold_answers)}


def keeping(follow_up, answered: list):
    """``follow_up``, keeping each answered turn's (prompt, answer token ids) in ``answered``
    (the runner's rows carry neither; the workload's own ``follow_up`` sees both)."""
    def keep(request, result):
        if result.ok:
            answered.append((list(request.prompt), list(result.token_ids)))
        return follow_up(request, result)
    return keep


@functools.cache
def oracle(overrides: tuple[str, ...]):
    """The decode side of the instances' spec, in this process (built once)."""
    from pdflow import LLM, compose

    return LLM.from_run_spec(compose([*base(list(overrides)), *overrides]))


def differing(args, answered: list[tuple[list[int], list[int]]]) -> int:
    """How many served answers differ from the decode side's own greedy answers in this
    process (printed: the first few)."""
    from pdflow import SamplingParams

    sampling = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = oracle(tuple(args.set)).generate([prompt for prompt, _ in answered], sampling)
    bad = [(len(p), ids, o.token_ids) for (p, ids), o in zip(answered, outs, strict=True) if list(o.token_ids) != ids]
    for n, served, theirs in bad[:3]:
        print(f"  differs: a {n}-token prompt served {served}, one process {theirs}", flush=True)
    return len(bad)


def separate(args, repeat: int = 1) -> dict[str, dict]:
    procs = []
    try:
        procs.append(start("prefill", *args.set))
        prefill = url_of(procs[-1])
        no_cache = ["router.prefix_reuse=false", "prefill.enable_prefix_caching=false",
                    "decode.enable_prefix_caching=false"]
        phases = {"off": ["router.prefix_reuse=false"], "on": [],
                  "on+local": [f"router.local_prefill_tokens={args.local}"], "none": no_cache}
        wanted, out = set(args.phases.split(",")), {}
        for seed, (name, extra) in enumerate(phases.items(), start=1):
            policies = {p: label for p, label in (("prefix", name), ("round_robin", "rr"))
                        if label in wanted and (label != "rr" or name == "on")}
            if not policies:
                continue
            if name == "none":  # a prefill instance without a prefix cache
                stop(procs)
                procs[:] = [start("prefill", *extra, *args.set)]
                prefill = url_of(procs[-1])
            decode = [start("decode", *extra, *args.set) for _ in range(args.decodes)]
            urls = [url_of(d) for d in decode]
            for i, (policy, label) in enumerate(policies.items()):
                router = start("router", f"serve.prefill=[{prefill}]", f"serve.decode=[{','.join(urls)}]",
                               f"router.policy={policy}", *args.set)
                try:
                    out[label] = drive_phase(args, url_of(router), prefill, urls, seed=seed * 10 + i,
                                             name=f"{label}_{repeat}")
                finally:
                    stop([router])
                print(f"{label:9s} { {k: v for k, v in out[label].items() if k not in ('ttfts', 'turns')} }",
                      flush=True)
            stop(decode)
        return out
    finally:
        stop(procs)


# -- one process ------------------------------------------------------------------------

def deployment(args) -> dict[str, dict]:
    from pdflow import Deployment, SamplingParams, compose

    sampling = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    out = {}
    with Deployment(compose([*base(args.set), *args.set])) as d:
        from pdflow.bench.workloads import RequestResult, build_workloads

        warm = workload_spec(args, seed=0)  # untimed: the first steps of each shape build and compile
        d.generate([r.prompt for r in build_workloads(warm, vocab=d.consumer.config.vocab_size)[0].requests()],
                   sampling)
        for seed, (label, reuse, share) in enumerate((("off", False, args.reuse), ("on", True, args.reuse),
                                                      ("no-reuse-workload", True, 0.0)), start=1):
            d.spec.router.prefix_reuse = reuse
            spec = workload_spec(args, seed)
            spec.prefix_reuse = share
            (w,) = build_workloads(spec, vocab=d.consumer.config.vocab_size)
            ttfts, cached, prompt, sent = [], 0, 0, d.kv_bytes_sent
            queue = list(w.requests())  # closed loop: each answer makes its conversation's next turn
            while queue:
                req = queue.pop(0)
                began, ids = time.perf_counter(), []
                for tok in d.stream([req.prompt], sampling):
                    if tok.index == 0:
                        ttfts.append(time.perf_counter() - began)
                        cached += tok.num_cached_tokens
                    ids.append(tok.token_id)
                prompt += len(req.prompt)
                if w.closed_loop and (after := w.follow_up(req, RequestResult(
                        ok=True, completion_tokens=len(ids), token_ids=ids))) is not None:
                    queue.append(after)
            out[label] = {"bytes": d.kv_bytes_sent - sent, "ttft_p50": statistics.median(ttfts),
                          "hit_rate": cached / prompt}
            print(f"{label:18s} {out[label]}", flush=True)
    return out


def pooled(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Each phase over every repeat: the p50 of all its requests' TTFTs, the median bytes
    and the mean hit rate; each repeat's own ratios to ``off`` printed first."""
    for i, run in enumerate(runs, start=1):
        if off := run.get("off"):
            print(f"repeat {i}: TTFT p50 / off: " + ", ".join(
                f"{label} {run[label]['ttft_p50'] / off['ttft_p50']:.3f}x" for label in run if label != "off"))
    return {label: {"bytes": statistics.median(r[label]["bytes"] for r in runs),
                    "ttft_p50": statistics.median(t for r in runs for t in r[label]["ttfts"]),
                    "hit_rate": statistics.fmean(r[label]["hit_rate"] for r in runs),
                    "turns": runs[0][label]["turns"]} for label in runs[0]}


def main() -> None:
    args = parse_args()
    if args.mode == "separate":
        out = pooled([separate(args, r) for r in range(1, max(1, args.repeat) + 1)])
    else:
        out = deployment(args)
    on, off = out.get("on"), out.get("off")
    print(f"\nprefix reuse at {args.reuse:.0%}, {args.conversations} conversations x {args.turns} turns, "
          f"first prompt {args.prompt_tokens} tokens, {args.max_tokens}-token answers "
          f"{'left out (open loop)' if args.open_loop else 'folded into the next turn (closed loop)'}, "
          + (f"think time {args.think:g} s, " if args.think else "")
          + (f"a {args.system_prompt}-token system prompt, " if args.system_prompt else "")
          + f"mode={args.mode}, set={args.set}"
          + (f", p50s over {args.repeat} repeats' requests pooled" if args.mode == "separate" and args.repeat > 1 else ""))
    if on and off:
        print(f"KV bytes sent     on/off: {on['bytes'] / off['bytes']:.3f}x (goal <= 0.3x)")
        print(f"TTFT p50          on/off: {on['ttft_p50'] / off['ttft_p50']:.3f}x (goal <= 0.5x)")
    if on and "none" in out:
        none = out["none"]
        print(f"TTFT p50         on/none: {on['ttft_p50'] / none['ttft_p50']:.3f}x (none: no prefix cache on "
              f"either side; {none['ttft_p50'] * 1e3:.0f} ms)")
        print(f"KV bytes sent    on/none: {on['bytes'] / none['bytes']:.3f}x")
    if "on+local" in out and off:
        local = out["on+local"]
        print(f"KV bytes sent  local/off: {local['bytes'] / off['bytes']:.3f}x")
        print(f"TTFT p50       local/off: {local['ttft_p50'] / off['ttft_p50']:.3f}x")
    if "rr" in out and on:
        print(f"decode hit rate prefix/rr: {on['hit_rate']:.3f} / {out['rr']['hit_rate']:.3f} = "
              f"{on['hit_rate'] / max(out['rr']['hit_rate'], 1e-9):.2f}x (goal >= 1.5x)")
    if args.mode == "separate" and ("rr" in out or on):
        best, rand = workload_bounds(args, (on or out["rr"])["turns"])
        print(f"this workload's bounds at {args.decodes} decode instances (no eviction): best {best:.3f}, "
              f"random placement {rand:.3f} = {best / rand:.2f}x apart")
    if "no-reuse-workload" in out and on:
        print(f"TTFT p50 at {args.reuse:.0%} reuse / no-reuse workload: "
              f"{on['ttft_p50'] / out['no-reuse-workload']['ttft_p50']:.3f}x")


if __name__ == "__main__":
    main()
