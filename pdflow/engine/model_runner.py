"""The in-process executor: the whole model (TP1/PP1) on this process's device."""

from __future__ import annotations

from collections import deque

import torch

from pdflow.engine.cuda_graphs import DecodeGraphRunner, graphs_supported
from pdflow.engine.stage_runner import StageRunner
from pdflow.model.decoder import CausalLM
from pdflow.parallel.messages import StepInput, StepOutput


class ModelRunner:
    """Runs each StepInput locally; the distributed executor answers the same calls.

    Decode steps replay CUDA graphs (one per batch-size bucket) when the device is CUDA,
    the backend is triton and ``block_table_width`` is given; everything else runs eagerly.
    One stage, so one step in flight: ``submit`` runs it, ``collect`` hands the result back.
    """

    depth = 1

    def __init__(
        self, model: CausalLM, *, device: torch.device, max_num_seqs: int = 256,
        block_table_width: int | None = None,
    ):
        self.stage = StageRunner(model, device)
        self.graphs = (
            DecodeGraphRunner(model, max_num_seqs, block_table_width, device)
            if block_table_width and graphs_supported(model, device)
            else None
        )
        self._done: deque[StepOutput] = deque()

    def submit(self, step: StepInput) -> None:
        self._done.append(self.execute(step))

    def collect(self) -> StepOutput:
        return self._done.popleft()

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        ids, positions, meta = self.stage.tensors(step)
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(ids, positions, meta)  # the graph's buffer: use it now
        else:
            hidden, _ = self.stage.forward(ids, positions, meta)
        return self.stage.output(step, self.stage.logits(step, hidden))

    def shutdown(self) -> None:
        pass
