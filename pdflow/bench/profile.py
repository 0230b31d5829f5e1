"""``pdflow profile``: measure this machine once, for ``pdflow plan --estimate``.

What the estimate needs and nothing else: the GEMM rate (all threads, and one thread,
since a CPU rank gets ``cores // world`` threads), memory bandwidth, host copy bandwidth
(device -> pinned host on a GPU), a transfer's bandwidth and latency per backend, the
latency of one owner <-> rank message, and the per-step host overhead of the real engine
(a served one-rank tiny-model decode step, less its compute). Since version 2 also the
model step table (``step_table``): pdflow's own decoder layer, head and sampling timed per
TP shard and thread count, which the estimate prices a step from, with the engine's
per-step and per-request serving costs measured against it. Saved as JSON; a profile says
which device and host it measured, and the estimate refuses to mix devices. An older file
(no table) still loads; the estimate then prices by the GEMM rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from pdflow.bench.step_table import StepTable, geometry_of

VERSION = 2  # 2: step tables and the serving costs measured against them
DEFAULT_PATH = Path("~/.cache/pdflow/profile.json")
PROFILE_ENV = "PDFLOW_PROFILE"
# Tokens of the by-size GEMM: a prefill step's batch (512 rows priced the tiny model's
# 2048-token prefill steps at a seventh of what they ran at).
ROWS = 2048


@dataclass(kw_only=True, slots=True)
class ServedProbe:
    """The tiny model served with ``tp`` x ``pp`` rank processes (``pdflow.serve.step_probe``):
    a decode step as served (with one stream, and with ``batch``: a stream's mean time
    per token, timed by the server) and first tokens as a client sees them."""

    step_s: float
    ttft_s: float
    tp: int = 1
    pp: int = 1
    disaggregated: bool = False  # P/D tp1 -> ``tp`` (first tokens only)
    batch: int = 1  # streams at once for ``batch_step_s``
    batch_step_s: float = 0.0  # the step with ``batch`` streams (0: not measured)
    # ``batch`` one-token requests at once: the median time to the last first token (0: not
    # measured); what a request costs when they come together, as a workload sends them
    batch_ttft_s: float = 0.0
    long_prompt_tokens: int = 0  # the same with prompts this long (0: not measured)
    batch_long_ttft_s: float = 0.0
    # prompt tokens/s of 2 x ``batch`` long prompts, ``batch`` at a time (0: not measured)
    prefill_tok_s: float = 0.0
    prompt_tokens: int  # of the request whose TTFT this is
    context: int  # mean context of the decode steps
    rounds: dict[str, list[float]] = field(default_factory=dict)  # each figure's rounds, for the record


@dataclass(kw_only=True, slots=True)
class MachineProfile:
    """Rates in per-second units; latencies in seconds."""

    device: str
    host: str
    cores: int
    gemm_flops_s: float
    gemm_flops_s_one_thread: float
    mem_bytes_s: float
    host_copy_bytes_s: float
    # backend (mooncake, nccl, cuda_ipc, gloo) -> bytes/s and one small message's latency.
    transfer_bytes_s: dict[str, float] = field(default_factory=dict)
    transfer_latency_s: dict[str, float] = field(default_factory=dict)
    rank_message_s: float = 0.0
    step_overhead_s: float = 0.0
    # Between two rank processes of this host (gloo on cpu, nccl on cuda): one all-reduce
    # of a small activation (TP, twice a layer) and one send/recv hop (a PP stage boundary).
    allreduce_s: float = 0.0
    hop_s: float = 0.0
    # What a step of a side with rank processes costs per stage beyond compute, its
    # collectives and the owner's overhead (served TP2 step vs TP1; 0 where not measured).
    rank_step_overhead_s: float = 0.0
    # GEMM rate (all threads) by a model's hidden size: [ROWS tokens, d] @ [d, 3d] (a
    # prefill step's shape); small matrices run well below the large-matrix rate.
    gemm_flops_s_by_dim: dict[str, float] = field(default_factory=dict)
    # 1: no step tables (files written before them).
    version: int = 1
    step_tables: list[StepTable] = field(default_factory=list)
    # Measured against the tiny model's table (0 where not measured): a served decode
    # step less its table-priced compute; a rank process's step work beyond that (served
    # TP2 step less its compute, all-reduces, message and the owner's overhead); a served
    # 4-token request's TTFT less its priced step (HTTP, tokenizing, admission, stream);
    # each row of a step beyond the first (its stream: detokenize, SSE chunk, the client).
    table_step_overhead_s: float = 0.0
    table_row_overhead_s: float = 0.0
    table_rank_step_overhead_s: float = 0.0
    request_overhead_s: float = 0.0
    # The part of a served request's cost that grows with its prompt, per prompt token
    # (4 requests at once of 4 and of 128 tokens; what arrives a step late waits a step).
    request_overhead_per_token_s: float = 0.0
    # Layouts served with rank processes ("tp2pp1", "tp1pp4", ...; ``served_costs``): a
    # stage's rank step work, and what a prefill step costs per token beyond its priced
    # compute, collectives and requests (ranks taking turns while activations move).
    table_rank_step_by_layout: dict[str, float] = field(default_factory=dict)
    rank_prefill_token_s_by_layout: dict[str, float] = field(default_factory=dict)
    # A P/D request's exchange between the instances beyond a monolithic one's serving
    # cost: per request, and per prompt token (P/D tp1 -> tp1 served; ``served_costs``);
    # per request by the rank pairs that move a prompt's KV (``RunGraph.cuts``; P/D tp1 ->
    # tp1: 1, tp1 -> tp4: 4): each pair's transfer is its own messages and answer, on the
    # same cores
    exchange_request_s: float = 0.0
    exchange_token_s: float = 0.0
    exchange_request_by_pairs: dict[str, float] = field(default_factory=dict)
    probes: list[ServedProbe] = field(default_factory=list)  # what the costs were derived from

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: Path) -> MachineProfile:
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}  # a field an older profile kept and this one derives no more
        raw = {k: v for k, v in raw.items() if k in known}
        raw["step_tables"] = [StepTable.from_dict(t) for t in raw.get("step_tables", [])]
        raw["probes"] = [ServedProbe(**p) for p in raw.get("probes", [])]
        return cls(**raw)

    def step_table(self, model) -> StepTable | None:
        """The table measured for ``model``'s geometry (a ``ModelSpec``) on this device."""
        want = geometry_of(model, self.device)
        return next((t for t in self.step_tables if t.geometry == want), None)

    def gemm_rate(self, hidden: int | None = None) -> float:
        """The measured rate at the size nearest ``hidden`` (log scale); the large-matrix
        rate when none was measured by size."""
        if not hidden or not self.gemm_flops_s_by_dim:
            return self.gemm_flops_s
        dim = min(self.gemm_flops_s_by_dim, key=lambda d: abs(math.log(int(d) / hidden)))
        return self.gemm_flops_s_by_dim[dim]

    def rank_flops_s(self, threads: int, hidden: int | None = None) -> float:
        """A CPU rank with ``threads`` of the machine's threads gets that share of its
        measured rate (one thread's rate at most per thread)."""
        rate = self.gemm_rate(hidden)
        if self.device != "cpu":
            return rate
        share = rate * min(1.0, max(1, threads) / max(1, self.cores))
        return min(share, max(1, threads) * self.gemm_flops_s_one_thread * rate / self.gemm_flops_s)


def layout_key(tp: int, pp: int) -> str:
    """A rank layout's key in the profile's by-layout tables."""
    return f"tp{tp}pp{pp}"


def default_path() -> Path:
    return Path(os.environ.get(PROFILE_ENV) or DEFAULT_PATH).expanduser()


def _timed(fn, *, min_s: float = 0.3, sync=lambda: None, rounds: int = 5) -> float:
    """Seconds per call: the best of ``rounds`` rounds of at least ``min_s / rounds``
    each (after a warm-up call), so a moment of load on a shared host is not the rate."""
    fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < min_s / rounds or calls < 2:
            fn()
            calls += 1
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _gemm(torch, device: str, n: int, sync) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    b = torch.randn_like(a)
    return 2.0 * n ** 3 / _timed(lambda: a @ b, sync=sync)


def _gemm_by_dim(torch, device: str, sync) -> dict[str, float]:
    dims = (256, 1024, 4096) if device == "cpu" else (1024, 4096, 8192)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    out = {}
    for d in dims:
        a = torch.randn(ROWS, d, device=device, dtype=dtype)
        b = torch.randn(d, 3 * d, device=device, dtype=dtype)
        out[str(d)] = 2.0 * ROWS * d * 3 * d / _timed(lambda a=a, b=b: a @ b, min_s=0.2, sync=sync)
    return out


def _tcp(size: int) -> tuple[float, float]:
    """Loopback TCP: bytes/s of a ``size`` send, and one 64-byte round trip."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo():
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(1 << 20):
                if len(data) == 64:
                    conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ping = b"x" * 64
    latency = _timed(lambda: (client.sendall(ping), client.recv(64)), min_s=0.2)
    blob = b"y" * size
    rate = size / _timed(lambda: client.sendall(blob), min_s=0.3)
    client.close()
    thread.join(timeout=5)
    server.close()
    return rate, latency


def _pipe_round_trip() -> float:
    """A 2 KiB message to a child process and back: an owner <-> rank step's floor."""
    import multiprocessing as mp

    ctx = mp.get_context("fork" if platform.system() == "Linux" else "spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_echo_pipe, args=(there,), daemon=True)
    child.start()
    msg = b"z" * 2048
    took = _timed(lambda: (here.send_bytes(msg), here.recv_bytes()), min_s=0.2)
    here.send_bytes(b"")
    child.join(timeout=5)
    return took


def _collectives(device: str) -> tuple[float, float]:
    """(all-reduce, send/recv hop) seconds between two processes, median of many."""
    import multiprocessing as mp
    import tempfile

    if device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < 2:  # NCCL refuses two ranks on one GPU: nothing to measure
            return 0.0, 0.0
    ctx = mp.get_context("spawn")
    answer = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_collective_rank, args=(r, f"{tmp}/store", device, answer)) for r in range(2)]
        for p in procs:
            p.start()
        got = answer.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
    return got


def _collective_rank(rank: int, store: str, device: str, answer) -> None:
    import statistics

    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    x = torch.ones(4, 1024, device=f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(fn, n=60) -> float:
        took = []
        for _ in range(n):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            took.append(time.perf_counter() - start)
        return statistics.median(took[5:])

    reduce = timed(lambda: dist.all_reduce(x))
    hop = timed(lambda: dist.send(x, 1) if rank == 0 else dist.recv(x, 0))
    if rank == 0:
        answer.put((reduce, hop))
    dist.destroy_process_group()


def _echo_pipe(conn) -> None:
    while msg := conn.recv_bytes():
        conn.send_bytes(msg)


def _step_overhead(step_s: float, gemm: float, mem: float) -> float:
    """A served tiny-model decode step (batch 1) less its compute."""
    from pdflow.spec.dtypes import dtype_bytes
    from pdflow.spec.load import compose_spec

    model = compose_spec(["model=tiny"]).model
    params = model.layers * model.params_per_layer() + model.vocab * model.hidden
    compute = max(2.0 * params / gemm, dtype_bytes(model.stored_weight_dtype) * params / mem)
    return max(0.0, step_s - compute)


def _copy_rates(torch, device: str, sync) -> tuple[float, float]:
    """Device memory bandwidth (a copy reads and writes) and device-to-host bytes/s; the
    buffers are freed on return."""
    big = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    out = torch.empty_like(big)
    mem = 2 * big.numel() / _timed(lambda: out.copy_(big), sync=sync)
    host = torch.empty(big.numel(), dtype=torch.uint8, pin_memory=device != "cpu")
    return mem, big.numel() / _timed(lambda: host.copy_(big, non_blocking=False), sync=sync)


def measure(device: str = "cpu", step_probe=None, *, models: tuple[str, ...] = ("tiny",),
            tps: tuple[int, ...] | None = None) -> MachineProfile:
    """``step_probe(device, tp[, pp])``: a ``ServedProbe`` of the tiny model served with
    ``tp`` x ``pp`` ranks (``pdflow.serve.step_probe``, which the command passes in: serving sits above
    this package). ``models``: config names to time a step table for (the tiny model's
    always, which the serving costs are measured against); ``tps``: their TP shards
    (default: 1, 2, 4 on a CPU, 1 on a GPU)."""
    import torch

    # served_costs prices with the estimate's Pricer, which reads this module: imported here
    from pdflow.bench.served_costs import exchange_costs, layout_costs, probe_graph, table_overheads
    from pdflow.bench.step_timing import measure_step_table
    from pdflow.spec.load import compose_spec

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    gemm = _gemm(torch, device, 1024 if device == "cpu" else 8192, sync)
    torch.set_num_threads(1)
    try:
        gemm_one = _gemm(torch, "cpu", 512, sync) if device == "cpu" else gemm
    finally:
        torch.set_num_threads(threads)
    mem, host_copy = _copy_rates(torch, device, sync)
    tcp_rate, tcp_latency = _tcp(16 << 20)
    rates = {"mooncake": tcp_rate, "gloo": tcp_rate}
    latencies = {"mooncake": tcp_latency, "gloo": tcp_latency}
    if device.startswith("cuda"):
        for name in ("nccl", "cuda_ipc"):  # one host: device-to-device copies
            rates[name], latencies[name] = mem / 2, 20e-6
    by_dim = _gemm_by_dim(torch, device, sync)
    allreduce, hop = _collectives(device)
    tps = tps or ((1, 2, 4) if device == "cpu" else (1,))
    tables = [measure_step_table([f"model={name}"], device, tps if name != "tiny" or device == "cpu" else (1,), cores,
                                 _timed) for name in dict.fromkeys(("tiny", *models))]
    rank_message = _pipe_round_trip()
    if device.startswith("cuda"):  # the probes start servers on this GPU: leave them its memory
        torch.cuda.empty_cache()
    one = step_probe(device, 1) if step_probe else None
    # Rank layouts served on a CPU (a GPU host's ranks each have a device): TP and PP of
    # 2 and 4, whose ranks share the cores; each priced from its own served probe.
    layouts = [(2, 1), (1, 2), (4, 1), (1, 4)] if step_probe and device == "cpu" else []
    served = {(tp, pp): step_probe(device, tp) if pp == 1 else step_probe(device, tp, pp) for tp, pp in layouts}
    exchange = {tp: step_probe(device, tp, disaggregated=True) for tp in ((1, 4) if layouts else ())}
    two = served.get((2, 1))
    layers = compose_spec(["model=tiny"]).model.layers
    rank_step = max(0.0, two.step_s - one.step_s / 2 - 2 * layers * allreduce) if two else 0.0
    table_step, table_row, table_rank, request, request_per_token = (
        table_overheads(tables[0], cores, layers, one, two, allreduce, rank_message) if one
        else (0.0, 0.0, 0.0, 0.0, 0.0))
    profile = MachineProfile(
        device="cuda" if device.startswith("cuda") else "cpu", host=platform.node(), cores=cores,
        gemm_flops_s=gemm, gemm_flops_s_one_thread=gemm_one, mem_bytes_s=mem, host_copy_bytes_s=host_copy,
        transfer_bytes_s=rates, transfer_latency_s=latencies, rank_message_s=rank_message,
        step_overhead_s=_step_overhead(one.step_s, gemm, mem) if one else 0.0,
        allreduce_s=allreduce, hop_s=hop, rank_step_overhead_s=rank_step, gemm_flops_s_by_dim=by_dim,
        version=VERSION, step_tables=tables, table_step_overhead_s=table_step, table_row_overhead_s=table_row,
        table_rank_step_overhead_s=table_rank, request_overhead_s=request,
        request_overhead_per_token_s=request_per_token,
        probes=[p for p in (one, *served.values(), *exchange.values()) if p is not None],
    )
    profile.table_rank_step_by_layout, profile.rank_prefill_token_s_by_layout = layout_costs(
        profile, list(served.values()))
    if 1 in exchange:
        profile.exchange_request_s, profile.exchange_token_s = exchange_costs(profile, exchange[1])
        profile.exchange_request_by_pairs = {
            str(probe_graph(p, profile.device).kv_pairs): exchange_costs(profile, p, per_token=profile.exchange_token_s)[0]
            for p in exchange.values()}
    return profile


def main(argv: list[str] | None = None, step_probe=None) -> int:
    parser = argparse.ArgumentParser(prog="pdflow profile", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (GPU 0)")
    parser.add_argument("--out", default=None, help=f"where to save it (default: ${PROFILE_ENV}, else {DEFAULT_PATH})")
    parser.add_argument("--model", action="append", default=None,
                        help="a model config to time a step table for (repeatable; the tiny model's always)")
    parser.add_argument("--tp", default=None, help="TP shards to time, e.g. 1,2,4 (default: 1,2,4 on cpu, 1 on cuda)")
    args = parser.parse_args(argv)
    tps = tuple(int(t) for t in args.tp.split(",")) if args.tp else None
    started = time.perf_counter()
    profile = measure(args.device, step_probe, models=tuple(args.model or ()), tps=tps)
    path = profile.save(Path(args.out).expanduser() if args.out else default_path())
    for key, value in asdict(profile).items():
        if key not in ("step_tables", "probes"):
            print(f"{key:26} {value}")
    for probe in profile.probes:
        kind = f"P/D tp1->tp{probe.tp}" if probe.disaggregated else f"tp{probe.tp} pp{probe.pp}"
        print(f"probe {kind}: " + "; ".join(
            f"{k} " + (" ".join(f"{v:.0f}" for v in vs) if k == "prefill_tok_s" else
                       " ".join(f"{v * 1e3:.1f}" for v in vs) + " ms") for k, vs in probe.rounds.items() if vs))
    for table in profile.step_tables:
        print(f"step table {table.model}: " + ", ".join(f"tp{s.tp}/{s.threads} threads" for s in table.shards))
    print(f"\nsaved: {path} ({time.perf_counter() - started:.0f} s)")
    return 0
