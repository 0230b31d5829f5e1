"""Table 1 of the GPU P/D bench: one request's head-cut KV through ``transfer=nccl`` and
``transfer=cuda_ipc``.

A TP1 producer on GPU 0 (every layer, every KV head of the model's geometry) writes a
request to a TP2 consumer: rank 1 on GPU 1 and rank 0 on GPU 0. With ``nccl`` the runs are
packed and move by NCCL between the GPUs, through an IPC-mapped receive buffer on the same
GPU; with ``cuda_ipc`` the producer's kernel writes them into the consumer's mapped caches
(NVLink to GPU 1). Three processes, as in a deployment. For each transfer, page size and
prompt length: GB/s of the p2p pair, one NCCL send of the same total bytes between the
same GPUs in the same run (plus an 8-byte ack back, as the pair acks), the ratio, the
same-GPU pair against a device copy of the same bytes, and whether every consumer rank
holds exactly its heads (the tests' tensor-indexing oracle, on the shortest prompt).

    python scripts/bench_gpu_transfer.py                       # 2 GPUs, Llama-3-8B heads
    python scripts/bench_gpu_transfer.py --device cpu --model tiny --tokens 256 --pages 16 --transfers nccl  # smoke
"""

# ruff: noqa: B023  (each lambda runs before its loop variables move on)
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from pdflow import compose  # noqa: E402
from pdflow.attention.kv_cache import TORCH_DTYPES  # noqa: E402
from pdflow.graph import CONSUMER, PRODUCER, build_graph  # noqa: E402
from pdflow.transfer.descriptors import Descriptors  # noqa: E402
from pdflow.transfer.grants import kv_nonce, pairing_token  # noqa: E402
from pdflow.transfer.p2p import P2PListener, P2PPeer, device_identity  # noqa: E402
from pdflow.transfer.packing import packed_nbytes  # noqa: E402

BLOCK = 128
KEY = bytes(32)  # the listeners' pairing key (``transfer.grants``): the bench grants its own requests
PAIRING = pairing_token(KEY)


def send(peer, src, dst) -> None:
    peer.send(src, dst, "bench", kv_nonce(KEY, dst))


def graph_for(model: str, page: int, device: str, staging_mib: int, transfer: str = "nccl", ramp: int = 0,
              programs: int = 0):
    spec = compose([f"model={model}", "prefill=tp1", "decode=tp2", "drafter=none", f"transfer={transfer}",
                    f"transfer.staging_mib={staging_mib}", "transfer.timeout_s=60", f"transfer.chunk_ramp={ramp}",
                    f"transfer.copy_programs={programs}",
                    f"prefill.block_size={BLOCK}", f"decode.block_size={BLOCK}", f"prefill.kv_page_tokens={page}",
                    f"decode.kv_page_tokens={page}", f"prefill.device={device}", f"decode.device={device}"])
    return build_graph(spec)


def caches(units, num_blocks: int, device, *, seed: int | None):
    out = {}
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    for u in units:
        cache = torch.empty(u.cache_shape(num_blocks), dtype=TORCH_DTYPES[u.dtype], device=device)
        raw = cache.view(-1).view(torch.uint8)
        if gen is None:
            raw.fill_(0xFF)
        else:
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=device, generator=gen))
        out[u.name] = cache
    return out


def _device(args, gpu: int):
    if args.device == "cuda":
        torch.cuda.set_device(gpu)
        return torch.device("cuda", gpu)
    return torch.device("cpu")


def _baseline_group(args, rank: int, path: str):
    store = dist.FileStore(path, 2)
    if args.device == "cuda":
        return dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def consumer(args, rank: int, inbox, outbox, base_path: str) -> None:
    device = _device(args, rank)
    group = _baseline_group(args, 1, base_path) if rank == 1 else None
    for page, transfer, ramp, programs in combos(args):
        graph = graph_for(args.model, page, args.device, args.staging_mib, transfer, ramp, programs)
        blocks = max(args.tokens) // BLOCK
        mine = caches(graph.rank(CONSUMER, rank).units, blocks, device, seed=None)
        # The buffer as given: this bench allocates its caches itself, so the graph's pool
        # (which would size the buffer to the longest request it holds) is not this one.
        listener = P2PListener(key=KEY, graph=graph, rank=rank, caches=mine, spec=graph.spec.transfer,
                               buffer_bytes=args.staging_mib << 20, transport=_transport(graph))
        outbox.put((rank, listener.address, device_identity(device)))
        while True:
            cmd = inbox.get()
            if cmd[0] == "baseline":
                buf = torch.empty(cmd[1], dtype=torch.uint8, device=device)
                ack = torch.zeros(1, dtype=torch.int64, device=device)
                for _ in range(cmd[2]):
                    group.recv([buf], 0, 0).wait()
                    group.send([ack], 0, 0).wait()
                outbox.put(("baseline-done", rank))
            elif cmd[0] == "check":
                import transfer_kit
                src = {0: caches(graph.rank(PRODUCER, 0).units, blocks, device, seed=args.seed)}
                bad = []
                for unit in graph.rank(CONSUMER, rank).units:
                    got = transfer_kit.as_bytes(mine[unit.name])[cmd[2]]
                    want = transfer_kit.expected_consumer(graph, src, rank, unit, mine[unit.name], cmd[1], cmd[2])
                    bad += [] if torch.equal(got, want[cmd[2]]) else [unit.name]
                outbox.put(("checked", rank, bad))
            elif cmd[0] == "next":
                listener.close()
                break


def producer(args, queues, outbox, result, base_path: str) -> None:
    device = _device(args, 0)
    group = _baseline_group(args, 0, base_path)
    cycles = _sleep_cycles(args.behind_step_ms, device)
    rows = []
    for page, transfer, ramp, programs in combos(args):
        graph = graph_for(args.model, page, args.device, args.staging_mib, transfer, ramp, programs)
        blocks = max(args.tokens) // BLOCK
        mine = caches(graph.rank(PRODUCER, 0).units, blocks, device, seed=args.seed)
        addresses = {}
        for _ in queues:
            rank, address, identity = outbox.get()
            addresses[rank] = (address, identity)
        peers = {}
        for cut in graph.cuts:
            plan = cut.over(set(mine))
            units = graph.rank(CONSUMER, cut.consumer_rank).units
            peers[cut.consumer_rank] = P2PPeer(
                pairing=PAIRING, address=addresses[cut.consumer_rank][0],
                consumer_device=addresses[cut.consumer_rank][1], plan=plan,
                caches=mine, dst_block_bytes={u.name: u.bytes_per_block for u in units}, producer_rank=0,
                spec=graph.spec.transfer, transport=_transport(graph))
        for tokens in args.tokens:
            n = tokens // BLOCK
            src = list(range(n))
            dst = list(range(n))[::-1]  # scattered: the consumer's blocks in another order
            row = {"transfer": label(transfer, ramp, programs), "page": page, "tokens": tokens}
            for rank, peer in peers.items():
                nbytes = packed_nbytes(peer.plan, n)
                secs = _timed(lambda p=peer: send(p, src, dst), args.reps, device)
                behind = _behind_step(lambda p=peer: send(p, src, dst), args.reps, device, cycles)
                row[f"r{rank}"] = (peer.mover, nbytes, nbytes / secs / 1e9, _rate(nbytes, behind))
            peer = peers.get(1)
            if peer is not None and peer.mover == "mooncake":  # Mooncake's own rate: one bare host write
                size = min(packed_nbytes(peer.plan, n), peer.sender.buffer_bytes)
                bare = Descriptors(src=[peer.sender.host_base], dst=[peer.sender.remote[1]], length=[size])
                row["mooncake_one"] = size / _timed(lambda: peer.transport.write(peer.sender.remote[0], bare),
                                                    args.reps, device) / 1e9
            row["both"] = sum(v[1] for k, v in row.items() if k.startswith("r")) / _timed(
                lambda: [send(p, src, dst) for p in peers.values()], args.reps, device) / 1e9
            nbytes = row["r1"][1]
            queues[1].put(("baseline", nbytes, args.reps + 2 + (args.reps if cycles else 0)))  # _timed, _behind_step
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            ack = torch.zeros(1, dtype=torch.int64, device=device)

            def one_send():
                group.send([buf], 1, 0).wait()
                group.recv([ack], 1, 0).wait()

            row["nccl_one"] = nbytes / _timed(one_send, args.reps, device) / 1e9
            row["nccl_one_behind"] = _rate(nbytes, _behind_step(one_send, args.reps, device, cycles))
            assert outbox.get()[0] == "baseline-done"
            other = torch.empty_like(buf)
            row["copy"] = nbytes / _timed(lambda: other.copy_(buf), args.reps, device) / 1e9
            row["copy_behind"] = _rate(nbytes, _behind_step(lambda: other.copy_(buf), args.reps, device, cycles))
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            row["d2h"] = nbytes / _timed(lambda: host.copy_(buf), args.reps, device) / 1e9
            if tokens == min(args.tokens):
                bad = []
                for q in queues.values():
                    q.put(("check", src, dst))
                for _ in queues:
                    _, rank, wrong = outbox.get()
                    bad += [f"r{rank}:{u}" for u in wrong]
                row["exact"] = "yes" if not bad else f"NO {bad[:4]}"
            rows.append(row)
            print(row, flush=True)
        for peer in peers.values():
            peer.close()
        for q in queues.values():
            q.put(("next",))
    result.put(rows)


def _transport(graph):
    """A Mooncake engine for this process when the transfer is Mooncake (staged pairs)."""
    if graph.spec.transfer.backend != "mooncake":
        return None
    from pdflow.transfer.mooncake_engine import MooncakeTransport

    return MooncakeTransport(graph.spec.transfer)


def combos(args) -> list[tuple[int, str, int, int]]:
    """(page, transfer, chunk ramp, copy programs): the ramps apply to the pipelined pairs
    (``nccl``) only, the copy programs to the GPU copies (``nccl``, ``cuda_ipc``)."""
    return [(page, transfer, ramp, programs) for page in args.pages for transfer in args.transfers
            for ramp in (args.chunk_ramps if transfer == "nccl" else args.chunk_ramps[:1])
            for programs in (args.copy_programs if transfer in ("nccl", "cuda_ipc") else args.copy_programs[:1])]


def label(transfer: str, ramp: int, programs: int) -> str:
    name = f"nccl ramp {ramp}" if transfer == "nccl" else transfer
    return f"{name}, {programs} programs" if programs else name


def _timed(fn, reps: int, device) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sleep_cycles(ms: float, device) -> int:
    """GPU clock cycles ``torch.cuda._sleep`` spins for ``ms`` milliseconds (0: no figure
    behind a step; CPU: none)."""
    if device.type != "cuda" or ms <= 0:
        return 0
    probe = 1_000_000
    torch.cuda._sleep(probe)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def _behind_step(fn, reps: int, device, cycles: int) -> float | None:
    """Median seconds from the end of a stand-in forward (``cycles`` of GPU sleep on the
    current stream) to the host knowing ``fn``'s bytes landed, ``fn`` issued while the
    sleep runs. A host head longer than the sleep still shows (the clock starts at the
    sleep's end, not at ``fn``'s first GPU work). None without a GPU."""
    if not cycles:
        return None
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        ready, landed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        ready.record()
        fn()
        torch.cuda.current_stream(device).synchronize()  # the host knows: as a send's return does
        landed.record()
        landed.synchronize()
        times.append(ready.elapsed_time(landed) / 1e3)
    return statistics.median(times)


def _rate(nbytes: int, secs: float | None) -> float | None:
    return None if secs is None else nbytes / secs / 1e9


def _ratio(gbs: float | None, base: float | None) -> str:
    return "-" if gbs is None or not base else f"{gbs / base:.2f}x"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(rows, args) -> str:
    out = ["| transfer | page | tokens | pair | mover | MiB | GB/s | baseline GB/s | ratio | behind a step: GB/s "
           "| baseline GB/s | ratio | exact |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for rank in (1, 0):
            mover, nbytes, gbs, behind = r[f"r{rank}"]
            base, name, base_behind = ((r["nccl_one"], "one send", r["nccl_one_behind"]) if rank == 1
                                       else (r["copy"], "device copy", r["copy_behind"]))
            if mover == "mooncake":  # staged through host memory: bound by one device-to-host copy
                base, name, base_behind = r["d2h"], "device to host", None
                if "mooncake_one" in r:
                    name += f"; one bare Mooncake write {r['mooncake_one']:.1f}"
            out.append(f"| {r['transfer']} | {r['page']} | {r['tokens']} | GPU0 -> rank {rank} | {mover} | "
                       f"{nbytes / 2**20:.0f} | {gbs:.1f} | {base:.1f} ({name}) | {gbs / base:.2f}x | "
                       f"{_num(behind)} | {_num(base_behind)} | {_ratio(behind, base_behind)} | "
                       f"{r.get('exact', '-')} |")
        out.append(f"| {r['transfer']} | {r['page']} | {r['tokens']} | both ranks, in turn | - | - | "
                   f"{r['both']:.1f} | - | - | - | - | - | - |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--pages", default="128,16")
    ap.add_argument("--transfers", default="nccl,cuda_ipc", help="transfer configs (conf/transfer) to run")
    ap.add_argument("--tokens", default="2048,16384")
    ap.add_argument("--staging-mib", type=int, default=256)
    ap.add_argument("--chunk-ramps", default="0", help="transfer.chunk_ramp values to run (nccl)")
    ap.add_argument("--copy-programs", default="0", help="transfer.copy_programs values to run (nccl, cuda_ipc)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--behind-step-ms", type=float, default=2.0,
                    help="the stand-in forward each transfer is issued behind (0: issued idle only)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.pages = [int(x) for x in args.pages.split(",")]
    args.transfers = args.transfers.split(",")
    args.chunk_ramps = [int(x) for x in args.chunk_ramps.split(",")]
    args.copy_programs = [int(x) for x in args.copy_programs.split(",")]
    args.tokens = sorted(int(x) for x in args.tokens.split(","))
    ctx = mp.get_context("spawn")
    outbox, result = ctx.Queue(), ctx.Queue()
    queues = {r: ctx.Queue() for r in (0, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "baseline")
        procs = [ctx.Process(target=consumer, args=(args, r, queues[r], outbox, base), daemon=True) for r in (0, 1)]
        procs.append(ctx.Process(target=producer, args=(args, queues, outbox, result, base), daemon=True))
        for p in procs:
            p.start()
        deadline = time.monotonic() + 540
        rows = None
        while rows is None and time.monotonic() < deadline and procs[-1].is_alive():
            try:
                rows = result.get(timeout=2)
            except Exception:
                continue
        for p in procs:
            p.kill()
    if rows is None:
        sys.exit("the producer process ended without a table")
    hw = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    from bench_engine import git_commit  # scripts/ sits beside this file

    commit = git_commit()
    print(f"\n# one request's head-cut KV through transfer={args.transfers} ({args.model} heads, TP1 -> TP2, "
          f"block {BLOCK}); baseline: one NCCL send of the same bytes + an 8-byte ack (rank 1, GPU 1), a "
          f"device copy of them (rank 0, GPU 0); issued idle (host clock, call to return) and behind a "
          f"{args.behind_step_ms} ms step (GPU clock, the step's end to the host knowing)")
    print(f"{hw}, torch {torch.__version__}, commit {commit or '?'}, {datetime.date.today()}; "
          f"command: {' '.join(sys.argv)}\n")
    print(table(rows, args))


if __name__ == "__main__":
    main()
