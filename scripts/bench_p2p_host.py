#!/usr/bin/env python
"""The host's share of a ``transfer=nccl`` request: what each step before the first chunk
moves costs on this machine, measured one by one between two GPUs (two processes, as a
pair runs). A packed pair's request waits for: the control message crossing to the
consumer's session thread, the consumer posting its receives, and the producer building
its rows, launching the first pack and the first send. Against ~3 ms for 1 GiB on the
wire, each 0.1 ms here is ~3% of the ratio ``bench_gpu_transfer.py`` prints.

Rows (median of ``--reps``, microseconds of host time):
- control message, one way: a request message (128 block ids) sent on the pair's kind of
  socket, stamped with ``CLOCK_MONOTONIC`` at both ends (one clock on one host), after an
  idle gap (the consumer's thread blocked in ``recv``) and back to back;
- the same with the receiving thread polling a non-blocking socket (what a blocked
  thread's wake-up costs);
- ``group.recv`` / ``group.send`` on a pair's NCCL group: the call's host time;
- one ``copy_runs`` launch (4096 runs), one eager ``addcmul``: host time per call.

    python scripts/bench_p2p_host.py                 # 2 GPUs
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_nccl_chunks import out_of_order_runs, two_ranks  # noqa: E402

from pdflow.transfer.p2p_messages import FramedSocket, P2PAck, P2PRequest  # noqa: E402

MiB = 1 << 20
CHUNK = 128 * MiB


def _us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _socket_rows(rank: int, store: dist.FileStore, reps: int, gap_s: float, poll: bool, key: str) -> float | None:
    """Median one-way time of a request message, rank 0 to rank 1 (rank 1 returns it)."""
    if rank == 1:
        server = socket.create_server(("127.0.0.1", 0))
        store.set(f"port{key}", str(server.getsockname()[1]))
        conn = FramedSocket(server.accept()[0])
        conn.sock.setblocking(not poll)
        lags = []
        for _ in range(reps + 2):
            while True:
                try:
                    msg = conn.recv()
                    break
                except BlockingIOError:  # polling: nothing yet (a frame is never split here)
                    continue
            lags.append(time.clock_gettime(time.CLOCK_MONOTONIC) - float(msg.request_id))
            conn.sock.setblocking(True)
            conn.send(P2PAck(index=0))
            conn.sock.setblocking(not poll)
        conn.close()
        server.close()
        store.set(f"lag{key}", str(statistics.median(lags[2:])))
        return None
    conn = FramedSocket(socket.create_connection(("127.0.0.1", int(store.get(f"port{key}")))))
    for _ in range(reps + 2):
        time.sleep(gap_s)
        conn.send(P2PRequest(request_id=repr(time.clock_gettime(time.CLOCK_MONOTONIC)), dst_blocks=list(range(128))))
        conn.recv()
    conn.close()
    return float(store.get(f"lag{key}"))


def _rank(rank: int, path: str, result, reps: int = 50) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.FileStore(path, 2)
    group = dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
    slots = torch.empty(2 * CHUNK, dtype=torch.uint8, device=dev)
    halves = [slots[:CHUNK], slots[CHUNK:]]
    (group.send if rank == 0 else group.recv)([halves[0]], 1 - rank, 0).wait()  # connect
    torch.cuda.synchronize()
    rows = {}
    for key, (name, gap, poll) in enumerate((("control message, one way, after 2 ms idle", 0.002, False),
                            ("control message, one way, back to back", 0.0, False),
                            ("control message, one way, after 2 ms idle, receiver polling", 0.002, True))):
        lag = _socket_rows(rank, store, reps, gap, poll, str(key))
        if lag is not None:
            rows[name] = lag * 1e6
    calls = {"first group.recv of a request (rank 1)": [], "second group.recv (rank 1)": [],
             "first group.send of a request (rank 0)": [], "second group.send (rank 0)": []}
    for _ in range(reps):
        time.sleep(0.002)
        works = []
        for i in range(2):
            t0 = time.perf_counter()
            if rank == 0:
                works.append(group.send([halves[i]], 1, 0))
            else:
                works.append(group.recv([halves[i]], 0, 0))
            took = time.perf_counter() - t0
            key = f"{'first' if i == 0 else 'second'} group.{'send' if rank == 0 else 'recv'}"
            calls[next(k for k in calls if k.startswith(key))].append(took)
        for w in works:
            w.wait()
        torch.cuda.synchronize()
    mine = {k: _us(v) for k, v in calls.items() if v}
    if rank == 1:
        store.set("calls", json.dumps(mine))
    else:
        rows.update(mine)
        rows.update(json.loads(store.get("calls")))
        from pdflow.kernels.copy_runs import copy_runs

        table = out_of_order_runs(halves[0], 4096 * 32 * 1024)  # into the second half
        a, b, out = (torch.ones(64, 128, 8, dtype=torch.int64, device=dev), torch.ones(1, 128, 1, dtype=torch.int64,
                     device=dev), torch.empty(64, 128, 8, dtype=torch.int64, device=dev))
        for name, fn in (("copy_runs launch, 4096 runs", lambda: copy_runs(table, 32 * 1024 // 8, shift=halves[1].data_ptr())),
                         ("eager addcmul", lambda: torch.addcmul(a, b, a, out=out))):
            times = []
            for _ in range(reps):
                torch.cuda.synchronize()
                time.sleep(0.001)
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            rows[name] = _us(times)
        result.put(rows)


def main() -> None:
    rows = two_ranks(_rank, 300)
    print(f"\n# host time on a transfer=nccl request's path (median, us); TORCH_NCCL_TRACE_BUFFER_SIZE="
          f"{os.environ.get('TORCH_NCCL_TRACE_BUFFER_SIZE', 'unset')}")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, commit {os.environ.get('PDFLOW_GIT_COMMIT', '?')}\n")
    print("| step | us |\n|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
