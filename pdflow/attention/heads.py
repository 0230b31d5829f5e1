"""Which global KV heads a tensor-parallel rank holds (DESIGN section 3)."""

from __future__ import annotations


def kv_heads_of_rank(num_kv_heads: int, tp_rank: int, tp_size: int) -> range:
    """Contiguous heads when they divide over ranks; with more ranks than heads each head
    is replicated and rank r holds head ``r // (tp_size / num_kv_heads)``."""
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        per_rank = num_kv_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_size % num_kv_heads:
        raise ValueError(f"{tp_size} ranks do not replicate {num_kv_heads} KV heads evenly")
    head = tp_rank // (tp_size // num_kv_heads)
    return range(head, head + 1)
