"""One side of a run graph (the prefill or the decode instance), as a live object.

It holds what a KV transfer, a drafter or an HTTP server attaches to: the role, the
graph's plan of its ranks, the units each rank holds (by unit name), the checkpoint's
config and tokenizer, and the executor that runs its ranks. The owner's scheduling lives
in ``LLMEngine``, which drives one instance.
"""

from __future__ import annotations

import time

import torch

from pdflow.engine.executor import Executor, make_executor
from pdflow.graph import (
    CONSUMER,
    PRODUCER,
    Code,
    InstancePlan,
    RankPlan,
    Refusal,
    UnitSpec,
    build_graph,
    parallel_of,
)
from pdflow.graph.devices import DeviceFacts
from pdflow.graph.host import read_devices
from pdflow.model.loader import model_config
from pdflow.model.tokenizer import load_tokenizer
from pdflow.parallel.messages import (
    ForgetConsumer,
    Forgot,
    KVEndpoint,
    KVLinkOpened,
    OpenKVLink,
    PairConsumer,
    Paired,
)
from pdflow.spec import RunSpec
from pdflow.transfer.errors import PairingRefused
from pdflow.transfer.grants import kv_nonce, new_key
from pdflow.worker.executors import InProcessExecutor
from pdflow.worker.stage import served_max_model_len

ROLES = (PRODUCER, CONSUMER)


def _expect(message, kind, role: str):
    if not isinstance(message, kind):
        raise RuntimeError(f"a {role} rank answered {type(message).__name__}, expected {kind.__name__}")
    return message


class Instance:
    def __init__(self, spec: RunSpec, role: str = CONSUMER, devices: DeviceFacts | None = None):
        """``devices``: the GPUs' memory read at start (None: read here when a side is on cuda)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        began = time.monotonic()
        self.spec, self.role = spec, role
        self.graph = build_graph(spec, devices or read_devices(spec)).raise_if_refused()
        self.plan: InstancePlan = self.graph.instance(role)
        self.parallel = parallel_of(spec, role)
        self.folder, self.config = model_config(spec.model)
        self.tokenizer = load_tokenizer(self.folder) if self.folder is not None else None
        self.num_kv_blocks = self.graph.budgets[role].pool_blocks
        self.max_model_len = served_max_model_len(self.graph, role, self.config)
        self.executor: Executor | None = make_executor(self.graph, role)
        # Seconds to ready (ranks built and warmed up), and of those spent compiling.
        self.startup_s = time.monotonic() - began
        self.compile_s = self.executor.compile_s
        # A consumer's pairing key: its ranks check producers' hellos and nonces with it.
        self.kv_key = new_key()

    @property
    def ranks(self) -> tuple[RankPlan, ...]:
        return tuple(self.plan.ranks)

    def units(self, rank: int) -> dict[str, UnitSpec]:
        """Every KV unit rank ``rank`` holds (target and draft), by the graph's unit name."""
        return {u.name: u for u in self.plan.ranks[rank].units}

    def kv_caches(self) -> dict[str, torch.Tensor]:
        """The KV pool by unit name, when the one rank runs in this process; a
        multi-process instance's pools live in its rank processes."""
        if not isinstance(self.executor, InProcessExecutor) or self.executor.stage is None:
            raise RuntimeError(f"the {self.role} instance's KV pools live in its rank processes")
        return self.executor.stage.kv_caches()

    # -- P/D --------------------------------------------------------------------------

    def open_kv_link(self) -> list[KVEndpoint]:
        """Register every rank's KV pool with the transfer engine; one endpoint per rank
        (what a consumer publishes to its producers)."""
        answers = self._executor().control(OpenKVLink(key=self.kv_key))
        return [_expect(a, KVLinkOpened, self.role).endpoint for a in answers]

    def kv_nonce(self, blocks) -> int:
        """The nonce granting a producer's transfer into these blocks of this (consumer)
        instance; its ranks refuse a transfer without it."""
        return kv_nonce(self.kv_key, blocks)

    def pair(self, consumer: list[KVEndpoint], consumer_id: str = "") -> None:
        """Give every producer rank the endpoints of consumer instance ``consumer_id``
        (kept beside other consumers'); each checks the units it will write against its
        plan. Raises ``PairingRefused`` (nothing written) on a mismatch."""
        if self.role != PRODUCER:
            raise ValueError(f"only a producer pairs with a consumer; this is the {self.role}")
        refusals = []
        for answer in self._executor().control(PairConsumer(endpoints=consumer, consumer=consumer_id)):
            refusals += [Refusal(code=Code(r.code), message=r.message, fix=r.fix)
                         for r in _expect(answer, Paired, self.role).refusals]
        if refusals:
            raise PairingRefused(refusals)

    def forget(self, consumer_id: str) -> bool:
        """Have every producer rank close and drop consumer instance ``consumer_id``'s peers
        (it stopped, or a transfer to it failed); exports in flight settle first. True when
        some rank held them."""
        if self.role != PRODUCER:
            raise ValueError(f"only a producer forgets a consumer; this is the {self.role}")
        answers = self._executor().control(ForgetConsumer(consumer=consumer_id))
        return any([_expect(a, Forgot, self.role).held for a in answers])

    def _executor(self) -> Executor:
        if self.executor is None:
            raise RuntimeError(f"the {self.role} instance has been shut down")
        return self.executor

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def shutdown(self) -> None:
        """Stop the ranks and give their device memory back."""
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
