"""One side of a run graph (the prefill or the decode instance), as a live object.

It holds what a KV transfer, a drafter or an HTTP server attaches to: the role, the
graph's plan of its ranks, the units each rank holds (by unit name), the checkpoint's
config and tokenizer, and the executor that runs its ranks. The owner's scheduling lives
in ``LLMEngine``, which drives one instance.
"""

from __future__ import annotations

import torch

from pdflow.engine.executor import Executor, make_executor
from pdflow.graph import CONSUMER, PRODUCER, InstancePlan, RankPlan, UnitSpec, build_graph, parallel_of
from pdflow.model.loader import model_config
from pdflow.model.tokenizer import load_tokenizer
from pdflow.spec import RunSpec
from pdflow.worker.executors import InProcessExecutor
from pdflow.worker.stage import served_max_model_len

ROLES = (PRODUCER, CONSUMER)


class Instance:
    def __init__(self, spec: RunSpec, role: str = CONSUMER):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.spec, self.role = spec, role
        self.graph = build_graph(spec).raise_if_refused()
        self.plan: InstancePlan = self.graph.instance(role)
        self.parallel = parallel_of(spec, role)
        self.folder, self.config = model_config(spec.model)
        self.tokenizer = load_tokenizer(self.folder) if self.folder is not None else None
        self.num_kv_blocks = self.graph.budgets[role].pool_blocks
        self.max_model_len = served_max_model_len(self.graph, role, self.config)
        self.executor: Executor | None = make_executor(self.graph, role)

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
