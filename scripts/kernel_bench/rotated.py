"""Candidates timed against one another and a same-traffic copy, in rotated rounds: the
harness the H200 probes under bench/results/ share (fp8 decode tiles, stages, register
caps). Each round times every candidate once, in CUDA graphs; the order rotates (even
rounds) or reverses (odd ones), since the second-timed of two kernels ran a few percent slow
on the H200 (bench/RESULTS.md); a ratio is the median over the rounds."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def graph_ms(fn: Callable[[], object]) -> float:
    """``fn`` replayed in a CUDA graph, median ms. The graph's stream does not wait for the
    one the inputs were made on: synchronize first."""
    import torch
    import triton.testing as tt

    torch.cuda.synchronize()
    return float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))


def rotated_times(fns: dict[str, Callable[[], object]], *, rounds: int = 3,
                  timer: Callable[[Callable[[], object]], float] = graph_ms) -> dict[str, list[float]]:
    """Each candidate's time in every round (ms), the rounds' order rotated or reversed."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r:] + names[:r] if r % 2 == 0 else list(reversed(names))
        for n in order:
            times[n].append(timer(fns[n]))
    return times


def vs_copy_lines(times: dict[str, list[float]], label: Callable[[str], str], *, copy: str = "copy") -> list[str]:
    """A line per candidate: the copy's time over its own, median and each round's."""
    cp = statistics.median(times[copy])
    lines = []
    for n, ts in times.items():
        if n == copy:
            continue
        rs = [c / t for c, t in zip(times[copy], ts, strict=True)]
        lines.append(f"{label(n)}: vs same-traffic copy {statistics.median(rs):.3f} (rounds "
                     f"{', '.join(f'{x:.3f}' for x in rs)}; {statistics.median(ts) * 1e3:.1f} us, "
                     f"copy {cp * 1e3:.1f} us)")
    return lines
