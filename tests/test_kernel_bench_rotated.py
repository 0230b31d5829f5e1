"""The probes' rotated-rounds harness (scripts/kernel_bench/rotated.py), on the CPU with a
stand-in timer: each round times every candidate once, in rotated then reversed order, and
a ratio is the copy's time over the candidate's, median over the rounds."""

from __future__ import annotations

from kernel_bench.rotated import rotated_times, vs_copy_lines


def test_rounds_rotate_and_reverse_and_ratios_are_medians():
    calls = []
    clock = {"a": [2.0, 4.0, 2.5], "b": [1.0, 1.0, 1.0], "copy": [1.0, 2.0, 2.0]}

    def timer(fn):
        name = fn()
        calls.append(name)
        return clock[name][sum(c == name for c in calls) - 1]

    times = rotated_times({n: (lambda n=n: n) for n in ("a", "b", "copy")}, timer=timer)
    assert calls == ["a", "b", "copy", "copy", "b", "a", "copy", "a", "b"]
    assert times == clock
    lines = vs_copy_lines(times, lambda n: f"case {n}")
    # a: copy/a per round 0.5, 0.5, 0.8 -> median 0.5; b: 1, 2, 2 -> 2
    assert lines[0].startswith("case a: vs same-traffic copy 0.500 (rounds 0.500, 0.500, 0.800; 2500.0 us")
    assert lines[1].startswith("case b: vs same-traffic copy 2.000 (rounds 1.000, 2.000, 2.000;")
    assert len(lines) == 2 and "copy 2000.0 us" in lines[0]
