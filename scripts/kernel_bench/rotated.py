"""Candidates timed against one another and a same-traffic copy, in rotated rounds: the
bench's ratios to a copy (``benchmarks.with_same_copy``) and the H200 probes under
bench/results/ (fp8 decode tiles, stages, register caps). Each round times every candidate
once, in CUDA graphs; the order rotates (even rounds) or reverses (odd ones), since the
second-timed of two kernels ran a few percent slow on the H200 (bench/RESULTS.md); a ratio
is the median over the rounds."""

from __future__ import annotations

from collections.abc import Callable


def graph_ms(fn: Callable[[], object]) -> float:
    """``fn`` replayed in a CUDA graph, median ms. ``do_bench_cudagraph`` runs ``fn`` on a
    stream of its own, which does not wait for the current one: inputs just made there (a
    random cache, its block table and lengths) may not be written yet when its first
    launches read them. Two runs ended in an illegal memory access right after making the
    8K page-128 inputs (bench/RESULTS.md): synchronize first."""
    import torch
    import triton.testing as tt

    torch.cuda.synchronize()
    return float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median"))


def same_traffic_copy(device, nbytes: int, *, graph: bool = True) -> Callable[[], object]:
    """A device copy moving ``nbytes`` in all (half read, half written), as a call: in a
    CUDA graph an SM copy (``torch.mul(src, 1, out=dst)``), since ``copy_`` captured
    becomes a copy-engine memcpy node (1 GiB moved took 0.40 ms in a graph, 0.26 ms
    eagerly, on the H200)."""
    import torch

    src = torch.randn(nbytes // 4, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    return (lambda: torch.mul(src, 1, out=dst)) if graph else (lambda: dst.copy_(src))


def rotated_times(fns: dict[str, Callable[[], object]], *, rounds: int = 3,
                  timer: Callable[[Callable[[], object]], float] = graph_ms) -> dict[str, list[float]]:
    """Each candidate's time in every round (ms), the rounds' order rotated or reversed
    (two candidates: which goes first swaps each round)."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r:] + names[:r] if r % 2 == 0 else list(reversed(names))
        for n in order:
            times[n].append(timer(fns[n]))
    return times


def median_and_range(ratios: list[float]) -> tuple[float, str]:
    """The median of per-round ratios, and their range as text."""
    ratios = sorted(ratios)
    return ratios[len(ratios) // 2], f"{ratios[0]:.3f}-{ratios[-1]:.3f}"


def copy_ratios(times: dict[str, list[float]], name: str, copy: str = "copy") -> list[float]:
    """The copy's time over ``name``'s, per round."""
    return [c / t for c, t in zip(times[copy], times[name], strict=True)]


def vs_copy_lines(times: dict[str, list[float]], label: Callable[[str], str], *, copy: str = "copy") -> list[str]:
    """A line per candidate: the copy's time over its own, median and each round's."""
    cp, _ = median_and_range(times[copy])
    lines = []
    for n, ts in times.items():
        if n == copy:
            continue
        rs = copy_ratios(times, n, copy)
        lines.append(f"{label(n)}: vs same-traffic copy {median_and_range(rs)[0]:.3f} (rounds "
                     f"{', '.join(f'{x:.3f}' for x in rs)}; {median_and_range(ts)[0] * 1e3:.1f} us, "
                     f"copy {cp * 1e3:.1f} us)")
    return lines
