"""What separately started P/D instances say to each other and to their router, on five
internal routes (under ``/pdflow/``, behind the API key like ``/v1``):

- ``GET /pdflow/instance`` on either instance: its ``InstanceCard`` (role, model, the run
  graph's fingerprint). A router refuses instances of different graphs before it serves.
- ``POST /pdflow/pair`` on a producer: a consumer's ``PairRequest`` (its KV endpoints);
  the producer checks the fingerprint and keeps them.
- ``POST /pdflow/unpair`` on a producer: a ``ForgetConsumer`` from a consumer that stops;
  the producer drops its endpoints and its ranks close their peers of it.
- ``POST /pdflow/prefill`` on a producer: a ``RemotePrefill``; the producer prefills,
  writes the prompt's KV into the consumer's blocks and answers a ``PrefillAnswer``.
- ``POST /pdflow/abort`` on a producer: an ``AbortPrefill`` from a consumer whose request
  ended first (its client gone, its time up); the producer drops the prefill, and its
  ``/pdflow/prefill`` answer waits until no step or export of it can still write.

The router names the producer in each request's ``x-pdflow-prefill`` header; the
consumer drives the exchange (docs/ARCHITECTURE.md, "Separately started instances").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import msgspec

from pdflow.engine.outputs import TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.engine.sequence import KVTarget
from pdflow.graph import build_graph
from pdflow.parallel.messages import KVEndpoint
from pdflow.spec import RunSpec

PREFILL_HEADER = "x-pdflow-prefill"
INSTANCE_PATH, PAIR_PATH, PREFILL_PATH = "/pdflow/instance", "/pdflow/pair", "/pdflow/prefill"
UNPAIR_PATH = "/pdflow/unpair"  # its body: the ``ForgetConsumer`` the producer then tells its ranks
ABORT_PATH = "/pdflow/abort"  # its body: an ``AbortPrefill``


class RunGraphMismatch(RuntimeError):
    """Two instances (or an instance and its router) were built from different run graphs:
    a producer would write KV laid out for another consumer."""


class InstanceCard(msgspec.Struct, kw_only=True):
    role: str
    model: str
    fingerprint: str
    max_model_len: int


class PairRequest(msgspec.Struct, kw_only=True):
    consumer_id: str
    fingerprint: str
    endpoints: list[KVEndpoint]


class RemotePrefill(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    # The request's own (checked again on decoding); the producer samples one token.
    sampling: SamplingParams
    target: KVTarget  # the consumer's blocks and their nonce, ``consumer`` its id


class AbortPrefill(msgspec.Struct, kw_only=True):
    """A consumer's request ended before its KV landed: the producer need not prefill it.
    The consumer still frees the blocks only on the prefill's answer."""

    consumer: str
    request_id: str  # the consumer's, as in its ``RemotePrefill``


class PrefillAnswer(msgspec.Struct, kw_only=True):
    """The prompt's first token once its KV landed, or why it did not (the consumer then
    frees the request's blocks)."""

    first: TokenOutput | None = None
    error: str | None = None


class RouteRefused(ValueError):
    """A backend cannot take a request's P/D route (not its prompt: the API's 400 names no
    body parameter)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PDRoute:
    """A request's part in a P/D exchange between separate instances, carried on its ticket
    to ``backend.add`` (none: served whole): ``prefill_at`` on a consumer (the producer URL
    the router's header names), ``remote`` on a producer (the consumer's job)."""

    prefill_at: str | None = None
    remote: RemotePrefill | None = None

    def __post_init__(self) -> None:
        if (self.prefill_at is None) == (self.remote is None):
            raise ValueError("a PDRoute names exactly one of prefill_at (a consumer's) and remote (a producer's)")


def fingerprint(spec: RunSpec) -> str:
    """The run graph both instances must share (placement, units, cuts, budgets) and the
    weights' identity; serving settings (ports, role) are left out."""
    graph = build_graph(spec).raise_if_refused()
    what = {"graph": graph.to_dict(), "model": spec.model.name, "dtype": spec.model.dtype,
            "drafter": spec.drafter.kind, "mode": spec.mode}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_same_graph(cards: dict[str, InstanceCard]) -> None:
    """Refuse a set of instances (by URL) that do not describe one run graph."""
    prints = {url: card.fingerprint for url, card in cards.items()}
    if len(set(prints.values())) > 1:
        listing = ", ".join(f"{url} ({cards[url].role}): {fp}" for url, fp in prints.items())
        raise RunGraphMismatch(f"the instances describe different run graphs: {listing}. Start every "
                               "instance with the same overrides (model, prefill, decode, drafter, transfer); "
                               "only serve.* may differ.")
