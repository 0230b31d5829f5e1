"""The in-process executor: the whole model (TP1/PP1) on this process's device."""

from __future__ import annotations

import torch

from pdflow.engine.stage_runner import StageRunner
from pdflow.model.decoder import CausalLM
from pdflow.parallel.messages import StepInput, StepOutput


class ModelRunner:
    """Runs each StepInput locally; the distributed executor answers the same calls."""

    def __init__(self, model: CausalLM, *, device: torch.device):
        self.stage = StageRunner(model, device)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        ids, positions, meta = self.stage.tensors(step)
        hidden, _ = self.stage.forward(ids, positions, meta)
        tokens, logprobs = self.stage.sample(step, self.stage.logits(step, hidden))
        return StepOutput(step=step.step, token_ids=tokens, logprobs=logprobs)

    def shutdown(self) -> None:
        pass
