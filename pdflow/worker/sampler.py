"""Turn the logits of one step into tokens: greedy, or temperature with top-k / top-p."""

from __future__ import annotations

import torch

from pdflow.parallel.messages import SamplingSpec


def sampling_probs(logits: torch.Tensor, params: SamplingSpec) -> torch.Tensor:
    """The distribution a non-greedy request samples from, for one row of logits [V]:
    softmax(logits / T), then the ``top_k`` most likely tokens, then the smallest set
    of the most likely whose mass reaches ``top_p``; renormalised."""
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # keeps the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


class Sampler:
    """Samples one token per row. Seeded requests draw from their own generator, so
    their tokens do not depend on the rest of the batch."""

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingSpec], generators: list
    ) -> tuple[list[int], list[float]]:
        tokens, chosen = self.on_device(logits, params, generators)
        return tokens.tolist(), chosen.tolist()

    def on_device(
        self, logits: torch.Tensor, params: list[SamplingSpec], generators: list
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [rows] (int64) and their logprobs [rows], left on the logits' device (no
        host read: overlap scheduling copies them back while the next step runs)."""
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            tokens = greedy
        else:
            tokens = greedy.clone()
            for row, p in enumerate(params):
                if not p.greedy:
                    probs = sampling_probs(logits[row], p)
                    tokens[row] = torch.multinomial(probs, 1, generator=generators[row])[0]
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        return tokens, chosen
