"""Pure arithmetic of placement: layer partitions, KV heads per rank, default taps."""

from __future__ import annotations


def heads_divisible(kv_heads: int, tp: int) -> bool:
    """A TP degree can split KV heads evenly, or replicate each head over tp/kv ranks."""
    return kv_heads % tp == 0 or tp % kv_heads == 0


def rank_heads(kv_heads: int, tp: int, tp_rank: int) -> tuple[int, ...]:
    """Global KV head ids held by one TP rank (replicated when tp > kv_heads)."""
    if tp <= kv_heads:
        per = kv_heads // tp
        return tuple(range(tp_rank * per, (tp_rank + 1) * per))
    return (tp_rank // (tp // kv_heads),)


def even_partition(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def lighter_last_partition(layers: int, stages: int) -> list[int]:
    """Give the last stage about 4/5 of an even share (it also holds the drafter).

    60 layers over 4 stages -> 16,16,16,12, the reference deployment's example.
    """
    if stages < 2:
        return [layers]
    last = max(1, (layers // stages) * 4 // 5)
    return even_partition(layers - last, stages - 1) + [last]


def default_taps(layers: int, count: int) -> list[int]:
    """``count`` taps spaced evenly from layer 1 to L-3 (deduplicated, ascending)."""
    lo, hi = 1, max(1, layers - 3)
    if count <= 1:
        return [hi]
    taps = {round(lo + i * (hi - lo) / (count - 1)) for i in range(count)}
    return sorted(taps)
