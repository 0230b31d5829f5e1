"""The sparse MoE MLP of Qwen3-MoE: a replicated router and every expert's SwiGLU, each
expert's intermediate dim cut across TP ranks like the dense MLP (no expert parallelism).

Routing is transformers' (``Qwen3MoeTopKRouter``): softmax of the router logits in fp32,
top-k, optional renormalisation, weights cast to the compute dtype. The CPU path runs the
experts as transformers does (one expert at a time over its tokens, ``index_add_``), so
fp32 greedy tokens equal transformers'; on CUDA with the fused kernels it runs
``kernels.fused_moe`` (two grouped GEMMs over the routed tokens). Under TP each rank's
combine is a partial sum, all-reduced once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdflow.kernels.reference_moe import route
from pdflow.model import fused as fusion
from pdflow.model.config import DecoderConfig
from pdflow.model.layers import _all_reduce, _divide


class ExpertWeights(nn.Module):
    """All experts of one layer, stacked as transformers holds them in memory:
    ``gate_up_proj`` [E, 2*I_local, H] (gate rows, then up rows) and ``down_proj``
    [E, H, I_local]. Loads per-expert checkpoint tensors (``experts.<e>.gate_proj``...,
    the released layout) or the stacked ones, and records which pieces came."""

    def __init__(self, cfg: DecoderConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.local = _divide(cfg.moe_intermediate_size, tp_size)
        self.tp_rank = tp_rank
        hidden = cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.local, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden, self.local))
        self.gate_up_proj.weight_loader = self.weight_loader
        self.down_proj.weight_loader = self.weight_loader
        self.loaded: set[tuple[str, int]] = set()

    def _rows(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of an intermediate dimension."""
        return full.narrow(dim, self.tp_rank * self.local, self.local)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        """``shard``: (kind, expert) for one expert's tensor (kind gate/up/down), None for
        a stacked [E, ...] tensor of the whole layer."""
        n = self.local
        if shard is None:
            if param is self.down_proj:
                param.data.copy_(self._rows(loaded, 2))
                self.loaded.update(("down", e) for e in range(self.num_experts))
            else:
                width = loaded.shape[1] // 2
                param.data[:, :n].copy_(self._rows(loaded[:, :width], 1))
                param.data[:, n:].copy_(self._rows(loaded[:, width:], 1))
                self.loaded.update((k, e) for k in ("gate", "up") for e in range(self.num_experts))
            return
        kind, expert = shard
        if kind == "down":
            param.data[expert].copy_(self._rows(loaded, 1))
        else:
            offset = 0 if kind == "gate" else n
            param.data[expert, offset:offset + n].copy_(self._rows(loaded, 0))
        self.loaded.add((kind, expert))

    def missing(self) -> list[tuple[str, int]]:
        """Expert pieces no checkpoint tensor filled (a parameter is otherwise 'set' when
        its first expert arrives)."""
        want = {(k, e) for k in ("gate", "up", "down") for e in range(self.num_experts)}
        return sorted(want - self.loaded)


class Router(nn.Module):
    """The replicated router: ``weight`` [E, H] (transformers' ``mlp.gate.weight``)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, K] in x's dtype, expert ids [T, K])."""
        return route(F.linear(x, self.weight), self.top_k, self.renormalize)


class SparseMoeBlock(nn.Module):
    """Router + experts (``mlp.gate``, ``mlp.experts`` as in the checkpoint)."""

    def __init__(self, cfg: DecoderConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.tp_size = tp_size
        self.gate = Router(cfg)
        self.experts = ExpertWeights(cfg, tp_rank, tp_size)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        weights, ids = self.gate(x)
        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        if fused:
            out = fusion.ops().fused_moe(x, w13, w2, weights, ids)
        elif x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = experts_all_dense(x, w13, w2, weights, ids)  # a decode graph, fused off
        else:
            out = experts_one_by_one(x, w13, w2, weights, ids)
        return out if self.tp_size == 1 else _all_reduce(out)


def experts_one_by_one(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """transformers' ``Qwen3MoeExperts.forward``: each hit expert in ascending order over
    its (pick, token) pairs in that order, rounded per op in x's dtype."""
    out = torch.zeros_like(x)
    n = w13.shape[1] // 2
    for expert in torch.unique(ids).tolist():
        pick, token = torch.where((ids == expert).t())
        gate, up = F.linear(x[token], w13[expert]).split(n, dim=-1)
        down = F.linear(F.silu(gate) * up, w2[expert]) * weights[token, pick, None]
        out.index_add_(0, token, down)
    return out


def experts_all_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Every expert over every row, weighted by its routing weight (0 where not picked):
    no host sync, so a CUDA graph can capture the unfused path (``experts_one_by_one``
    reads the hit experts on the host). E times the FLOPs; equal up to summation order."""
    n = w13.shape[1] // 2
    routing = torch.zeros(x.shape[0], w13.shape[0], dtype=weights.dtype, device=x.device)
    routing.scatter_(1, ids, weights)
    gate, up = torch.einsum("th,enh->etn", x, w13).split(n, dim=-1)
    down = torch.einsum("etn,ehn->eth", F.silu(gate) * up, w2)
    return (down * routing.t()[:, :, None]).sum(dim=0)
