#!/usr/bin/env python
"""KV transfer throughput over the Mooncake Transfer Engine: whole blocks vs head cuts.

One producer rank writes one request's KV into one consumer rank through ``KVExporter``
and ``KVImporter`` (two engines in this process, TCP loopback), for:

- whole-block: TP4 -> TP4, rank 0 -> rank 0 (one head each side: every unit's block is
  one contiguous run);
- head-cut page 128 / page 16: TP1 (all 4 KV heads, one PP stage's view) -> TP4 rank 0
  (its one head): one run per page of every unit's block, 1 or 8 per block;

each by the direct path (one descriptor per run) and the packed path (gather into a send
buffer, one write, scatter on the consumer), timed from the export call to the end of
the consumer's scatter. All move the same bytes per request. Block ids are scattered, as
a serving block pool hands them out, so no descriptor spans two blocks. The reference is
an in-process memcpy of the same number of bytes. Shapes: ``small`` is the shipped
model's KV geometry (8 layers, 4 KV heads, d64, fp32), ``large`` a realistic one (60
layers, 4 KV heads, d128, bf16); block 128 for both. Prints a table, ratios last.

    python scripts/bench_transfer.py                   # both shapes, ~1-2 min on 2 cores
    python scripts/bench_transfer.py --shapes large --large-tokens 8192 --repeats 5
    python scripts/bench_transfer.py --dry-run         # tiny, for the test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
CASES = [  # (case, overrides of prefill/decode)
    ("whole-block", ["prefill=tp4", "decode=tp4", "prefill.kv_page_tokens=128", "decode.kv_page_tokens=128"]),
    ("head-cut page 128", ["prefill=tp1", "decode=tp4", "prefill.kv_page_tokens=128", "decode.kv_page_tokens=128"]),
    ("head-cut page 16", ["prefill=tp1", "decode=tp4", "prefill.kv_page_tokens=16", "decode.kv_page_tokens=16"]),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="small,large", help="comma list of small, large")
    p.add_argument("--small-tokens", type=int, default=2048, help="prompt tokens of a small-shape request")
    p.add_argument("--large-tokens", type=int, default=2048, help="prompt tokens of a large-shape request")
    p.add_argument("--large-layers", type=int, default=60)
    p.add_argument("--repeats", type=int, default=5, help="timed requests per case (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for gather/scatter/memcpy")
    p.add_argument("--descriptor-batch", type=int, default=1024)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, one repeat (for the test)")
    p.add_argument("--json", default="", help="also write the rows here")
    return p.parse_args()


def shape_overrides(shape: str, args) -> tuple[list[str], int]:
    # model.path=null: a geometry of our own (no weights are read to move KV bytes).
    if shape == "small":
        return ["model.path=null", "model.layers=2" if args.dry_run else "model.layers=8"], args.small_tokens
    layers = 2 if args.dry_run else args.large_layers
    return ["model.path=null", f"model.layers={layers}", "model.head_dim=128", "model.kv_dtype=bf16"], \
        args.large_tokens


def build(overrides: list[str], staging: bool, request_bytes: int, args):
    from pdflow.graph import build_graph
    from pdflow.spec.load import compose_spec

    staging_mib = max(1, -(-request_bytes // (1 << 20)) + 1)
    spec = compose_spec(["drafter=none", *overrides, f"transfer.staging={str(staging).lower()}",
                         f"transfer.staging_mib={staging_mib}", f"transfer.descriptor_batch={args.descriptor_batch}",
                         "transfer.timeout_s=120"])
    return build_graph(spec).raise_if_refused()


def caches(units, num_blocks: int) -> dict[str, torch.Tensor]:
    out = {}
    for u in units:
        t = torch.empty(u.cache_shape(num_blocks), dtype=INT_OF_SIZE[u.itemsize])
        t.view(-1).view(torch.uint8).fill_(u.layer % 251)
        out[u.name] = t
    return out


class Case:
    """Producer rank 0 and consumer rank 0 of one graph, paired, with their caches."""

    def __init__(self, graph, producer_t, consumer_t, blocks: int):
        from pdflow.transfer import KVExporter, KVImporter

        self.graph, self.blocks, self.num = graph, blocks, blocks + 4
        self.producer_t, self.consumer_t = producer_t, consumer_t
        self.exporter = KVExporter(graph, 0, caches(graph.rank("prefill", 0).units, self.num), producer_t)
        self.importer = KVImporter(graph, 0, caches(graph.rank("decode", 0).units, self.num), consumer_t,
                                   instance=f"bench-{id(self)}", reply_to="tcp://127.0.0.1:1")
        paired = self.exporter.pair(self.importer.hello())
        assert paired.ok, paired.refusals
        self.exporter.probes[(self.importer.instance, 0)].result()
        self.gen = torch.Generator().manual_seed(0)
        self.seconds: list[float] = []
        self.calls = 0

    def request(self, timed: bool) -> None:
        """One request (export + scatter) into scattered blocks on both sides."""
        src = torch.randperm(self.num, generator=self.gen)[:self.blocks].tolist()
        dst = torch.randperm(self.num, generator=self.gen)[:self.blocks].tolist()
        before = self.producer_t.stats.calls
        start = time.perf_counter()
        [want] = self.importer.expect(f"r{len(self.seconds)}-{timed}", dst).values()
        done = self.exporter.export(want, src)
        outcome = self.importer.on_done(done)
        took = time.perf_counter() - start
        if outcome is None or not outcome.ok:
            raise RuntimeError(f"request failed: {done.error}")
        if timed:
            self.seconds.append(took)
            self.calls = max(self.calls, self.producer_t.stats.calls - before)

    def row(self) -> dict:
        cut = self.graph.cut(0, 0)
        nbytes = cut.bytes_per_block * self.blocks
        median = statistics.median(self.seconds)
        return {"bytes": nbytes, "seconds": median, "gbps": nbytes / median / 1e9,
                "runs_per_block": cut.descriptors_per_block, "engine_calls": self.calls}

    def close(self) -> None:
        self.exporter.close()
        self.importer.close()


def time_memcpy(nbytes: int, repeats: int) -> dict:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    return {"bytes": nbytes, "seconds": statistics.median(seconds), "gbps": nbytes / statistics.median(seconds) / 1e9,
            "runs_per_block": 0, "engine_calls": 0}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from pdflow.spec import TransferSpec
    from pdflow.transfer import MooncakeTransport

    repeats = 1 if args.dry_run else args.repeats
    spec = TransferSpec(protocol="tcp", descriptor_batch=args.descriptor_batch, timeout_s=120)
    producer_t, consumer_t = MooncakeTransport(spec), MooncakeTransport(spec)
    rows = []
    began, load = time.perf_counter(), os.getloadavg()[0]
    for shape in args.shapes.split(","):
        overrides, tokens = shape_overrides(shape, args)
        blocks = max(1, (256 if args.dry_run else tokens) // 128)
        probe = build([*overrides, *CASES[0][1]], False, 0, args)
        request_bytes = probe.cut(0, 0).bytes_per_block * blocks
        geometry = probe.rank("decode", 0).units[0]
        label = (f"{shape}: {len(probe.rank('decode', 0).target_units) // 2} layers, d{geometry.head_dim} "
                 f"{geometry.dtype}, {blocks} blocks")
        rows.append({"shape": label, "case": "memcpy (in-process)", "path": "-", **time_memcpy(request_bytes, repeats)})
        cases = {}
        for case, case_overrides in CASES:
            for path in ("direct", "packed"):
                graph = build([*overrides, *case_overrides], path == "packed", request_bytes, args)
                cases[(case, path)] = Case(graph, producer_t, consumer_t, blocks)
        try:
            for r in range(repeats + 1):  # round robin, so load on a shared machine hits all alike
                for one in cases.values():
                    one.request(timed=r > 0)  # the first round warms up (page faults, lanes)
        finally:
            for one in cases.values():
                one.close()
        for (case, path), one in cases.items():
            rows.append({"shape": label, "case": case, "path": path, **one.row()})
            print(f"  {label} | {case} {path}: {rows[-1]['gbps']:.3f} GB/s", flush=True)
    rows.append({"load_avg_1min_at_start": load, "threads": args.threads})
    report(rows, time.perf_counter() - began)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    producer_t.close()
    consumer_t.close()


def report(rows: list[dict], seconds: float) -> None:
    *rows, meta = rows
    print("\n| shape | case | path | runs/block | engine calls | MiB | GB/s | vs memcpy |\n|---|---|---|---|---|---|---|---|")
    ref = {r["shape"]: r["gbps"] for r in rows if r["path"] == "-"}
    for r in rows:
        print(f"| {r['shape']} | {r['case']} | {r['path']} | {r['runs_per_block']} | {r['engine_calls']} | "
              f"{r['bytes'] / 2**20:.1f} | {r['gbps']:.3f} | {r['gbps'] / ref[r['shape']]:.3f}x |")
    print("\nratios (goal: head-cut page 16 >= 0.8x whole-block)")
    for shape in ref:
        got = {(r["case"], r["path"]): r["gbps"] for r in rows if r["shape"] == shape}
        whole = max(got[("whole-block", "direct")], got[("whole-block", "packed")])
        for path in ("packed", "direct"):
            print(f"  {shape}: head-cut page 16 {path} / best whole-block = "
                  f"{got[('head-cut page 16', path)] / whole:.2f}x; / whole-block direct = "
                  f"{got[('head-cut page 16', path)] / got[('whole-block', 'direct')]:.2f}x")
    print(f"({seconds:.0f} s; 1-min load average at start {meta['load_avg_1min_at_start']:.1f} on "
          f"{os.cpu_count()} CPUs; {meta['threads']} torch thread(s))")


if __name__ == "__main__":
    main()
