"""How requests meet P/D instances: the router's choice of instances, and the decode
side's use of its own prefix cache (see docs/ARCHITECTURE.md, "Prefix reuse and routing")."""

from __future__ import annotations

from dataclasses import dataclass

ROUTER_POLICIES = ("round_robin", "load", "prefix")


@dataclass(kw_only=True, slots=True)
class RouterSpec:
    # round_robin: instances in turn; load: the one with the fewest requests the router
    # has in flight there (from the send; on a prefill instance, until the decode
    # instance's answer, when its prefill and transfer are over); prefix: the decode
    # instance holding most of the prompt's leading blocks (a router-side index of what it
    # sent where; runs within prefix_min_gain of the longest are a tie), ties by load.
    policy: str = "round_robin"
    # Decode side: match each prompt against this instance's prefix cache and have the
    # prefill instance write only the uncached suffix's blocks.
    prefix_reuse: bool = True
    # Decode side: a prompt whose uncached part is shorter than this many tokens is
    # prefilled by the decode instance itself (no transfer); 0: never.
    local_prefill_tokens: int = 0
    # Decode side, with local prefill on: also prefill locally when a producer would have
    # to compute at least this many times the tokens this instance would, because its
    # cache lacks what this instance computed itself (earlier local prefills, generated
    # answers): a conversation's turns prefilled here would otherwise send a longer turn
    # to a producer that recomputes the whole conversation. 0: off.
    local_prefill_factor: float = 2.0
    # Prefix policy: block hashes the router remembers per decode instance (LRU bound).
    index_blocks: int = 65536
    # Prefix policy: an instance's leading-block overlap must beat another's by at least
    # this fraction of the prompt's blocks to go before it; closer overlaps are a tie that
    # load breaks. A prefix every conversation shares (a system prompt) then spreads new
    # conversations instead of sending them all where it went first. 0: any overlap wins.
    prefix_min_gain: float = 0.25
    # Prefix policy: the instance the overlap picks is passed over for the least loaded one
    # when it has at least this many more requests in flight (a hot conversation or prefix
    # does not pile onto one instance). 0: never.
    prefix_max_skew: int = 32
    # Load policy: a prefill instance with this many prefills in flight (sent, their decode
    # instance's answer not yet back) is saturated;
    # when all are, the decode instance prefills locally. 0: no limit.
    max_prefills_in_flight: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"router.policy {self.policy!r} is not one of {ROUTER_POLICIES}")
        if self.local_prefill_tokens < 0 or self.max_prefills_in_flight < 0:
            raise ValueError("router.local_prefill_tokens and router.max_prefills_in_flight must be >= 0 "
                             "(0: never prefill locally / no limit)")
        if self.local_prefill_factor != 0 and self.local_prefill_factor <= 1:
            raise ValueError(f"router.local_prefill_factor must be above 1 (a producer computing at least that "
                             f"many times this instance's tokens), or 0 (off); got {self.local_prefill_factor}")
        if not 0.0 <= self.prefix_min_gain < 1.0 or self.prefix_max_skew < 0:
            raise ValueError(f"router.prefix_min_gain must be in [0, 1) (a fraction of the prompt's blocks) and "
                             f"router.prefix_max_skew >= 0 (requests in flight; 0: off), got "
                             f"{self.prefix_min_gain} and {self.prefix_max_skew}")
        if self.index_blocks < 1:
            raise ValueError(f"router.index_blocks must be >= 1 (block hashes kept per decode instance), "
                             f"got {self.index_blocks}")
