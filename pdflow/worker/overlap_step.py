"""Overlap scheduling on one rank: launch a step and return with its samples still on the
device, so the owner schedules and builds the next step while this one runs.

The sampled tokens stay on the device for the next step's placeholder rows (gathered by
``StageRunner.tensors``), and a non-blocking copy to pinned host memory, fenced by an
event, brings them to the owner when it collects the step. One stream orders it all: the
next step's gather runs after this step's sampling, its K/V writes after this step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdflow.parallel.messages import PromptLogprobs, StepInput, StepOutput, TopLogprobs
from pdflow.worker.logprobs import sampled_top
from pdflow.worker.stage import Stage


@dataclass(kw_only=True, slots=True)
class LaunchedStep:
    """A step on its way: its samples' host copies and the event that says they landed."""

    step: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    done: torch.cuda.Event | None
    graphed: bool
    taps: torch.Tensor | None = None
    # Logprobs the step asked for (read at launch: only requests that ask wait for them).
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)

    def result(self) -> StepOutput:
        """Wait for the step's samples and answer as the synchronous path would."""
        if self.done is not None:
            self.done.synchronize()
        out = StepOutput(step=self.step, token_ids=self.tokens.tolist(), logprobs=self.logprobs.tolist(),
                         cuda_graph=self.graphed,
                         top_logprobs=self.top_logprobs, prompt_logprobs=self.prompt_logprobs)
        if self.taps is not None:
            out.taps, out.taps_shape = self.taps.numpy().tobytes(), list(self.taps.shape)
        return out


def _to_host(values: torch.Tensor) -> torch.Tensor:
    if values.device.type != "cuda":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    return host.copy_(values, non_blocking=True)


@torch.inference_mode()
def launch(stage: Stage, step: StepInput, samples: torch.Tensor | None) -> tuple[LaunchedStep, torch.Tensor]:
    """Queue ``step`` (its placeholders read ``samples``, the last step's tokens on the
    device); returns the launched step and this step's tokens on the device."""
    if stage.drafting is not None:
        raise RuntimeError("overlap scheduling runs without a drafter (the graph resolves it off)")
    device = stage.runner.device
    ids, positions, meta = stage.runner.tensors(step, samples)
    hidden, taps, graphed = stage.forward(ids, positions, meta)
    if step.exports:  # the sender's reads wait on an event recorded after this forward
        stage.export(step.exports)
    logits = stage.runner.logits(step, hidden)
    if logits is None:
        stage.runner.sample(step, None)  # drops released requests' generators
        tokens = torch.empty(0, dtype=torch.int64, device=device)
        logprobs = torch.empty(0, dtype=torch.float32, device=device)
    else:
        tokens, logprobs = stage.runner.sample_on_device(step, logits)
    host_taps = taps.float().cpu().contiguous() if step.capture_taps and taps is not None else None
    launched = LaunchedStep(step=step.step, tokens=_to_host(tokens), logprobs=_to_host(logprobs),
                            done=None, graphed=graphed, taps=host_taps,
                            prompt_logprobs=stage.score_prompts(step, hidden))
    if step.top_logprobs and logits is not None:
        launched.top_logprobs = sampled_top(step, logits)
    if device.type == "cuda":
        launched.done = torch.cuda.Event()
        launched.done.record()
    return launched, tokens
