"""Building blocks whose weights can be sharded for tensor parallelism.

Each parameter carries a ``weight_loader(param, loaded, shard=None)`` that copies this
rank's slice of a full checkpoint tensor, so TP slots in by passing ``tp_rank`` and
``tp_size`` (default 1: the whole tensor). Forward passes reduce across ranks only when
``tp_size > 1``.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from pdflow.graph.heads import heads_divisible, rank_heads
from pdflow.model import fused as fusion


def _divide(total: int, parts: int) -> int:
    if total % parts:
        raise ValueError(f"{total} does not split evenly over {parts} tensor-parallel ranks")
    return total // parts


# The process group of this rank's TP peers (its PP stage); None: the default group.
_TP_GROUP = None


def set_tp_group(group) -> None:
    """Called by a rank before it builds its stage (several stages share one world)."""
    global _TP_GROUP
    _TP_GROUP = group


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(x, group=_TP_GROUP)
    return x


SMALL_M_ENV = "PDFLOW_SMALL_M_LINEAR"


@functools.cache
def _small_m_linear():
    """``kernels.small_m_linear`` (None when ``PDFLOW_SMALL_M_LINEAR=0``), imported on first use."""
    if os.environ.get(SMALL_M_ENV, "1").strip() == "0":
        return None
    import pdflow.kernels.small_m_linear as small_m

    return small_m


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except fp32 CUDA products of 2-16 rows (a drafted step's verify and
    block) of the shapes cuBLAS runs on a slow SIMT GEMM (``small_m_linear.wins``): those go
    to an exact-fp32 Triton kernel. One row keeps cuBLAS's gemv; CPU and 16-bit dtypes are
    untouched."""
    if x.is_cuda and x.dtype == torch.float32 and weight.stride(-1) == 1 and x.shape[-1]:
        kernel = _small_m_linear()
        if kernel is not None and kernel.wins(x.numel() // x.shape[-1], weight.shape[0], x.shape[-1]):
            SMALL_M_SHAPES.add((weight.shape[0], x.shape[-1], weight.stride(0), bias is not None, x.device))
            return kernel.small_m_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# (N, K, the weight's row stride, has a bias, device) of every product ``linear`` sent to
# the small-row kernel, so that a warm-up compiles its other row classes: a request may
# meet any of them.
SMALL_M_SHAPES: set[tuple[int, int, int, bool, torch.device]] = set()


def warm_small_m_row_classes(device: torch.device) -> int:
    """Compile every row class of each small-row product met on ``device`` so far; how
    many shapes."""
    kernel = _small_m_linear()
    if device.type == "cuda" and device.index is None:  # as a tensor's device reads
        device = torch.device("cuda", torch.cuda.current_device())
    shapes = [s for s in SMALL_M_SHAPES if s[-1] == device] if kernel is not None else []
    for n, k, row_stride, has_bias, _ in shapes:
        weight = torch.zeros(n, row_stride, device=device)[:, :k]  # the same stride class
        bias = torch.zeros(n, device=device) if has_bias else None
        for rows in kernel.ROW_CLASSES:
            kernel.small_m_linear(torch.zeros(rows, k, device=device), weight, bias)
    return len(shapes)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose product is ``linear``'s: for
    unsharded projections such as a drafter's feature fusion."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm as HF computes it: statistics in fp32, weight applied in the input dtype.

    Given the residual stream, it adds it first and returns ``(norm(x + residual),
    x + residual)`` (vLLM's pattern: one fused kernel for add and norm on GPU)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *,
                fused: bool = False):
        if fused:
            return fusion.ops().rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call (composed in C++, no Python between the ops); same bits in fp32 (tested).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class ShardedLinear(nn.Module):
    """A linear layer holding one rank's slice; subclasses say which dimension is cut."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(ShardedLinear):
    """Output features cut across ranks; no communication in forward."""

    def __init__(self, in_features, out_features, bias=False, tp_rank=0, tp_size=1):
        super().__init__(in_features, _divide(out_features, tp_size), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard=None):
        rows = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stacked (gate and up); ``shard`` is the index."""

    def __init__(self, in_features, out_sizes: list[int], bias=False, tp_rank=0, tp_size=1):
        self.local_sizes = [_divide(s, tp_size) for s in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard=None):
        size = self.local_sizes[shard]
        start = sum(self.local_sizes[:shard])
        piece = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, start, size).copy_(piece)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections stacked; ranks take whole heads. With more ranks than KV heads a
    KV head is replicated: rank r holds KV head ``r // (tp_size / kv_heads)``."""

    def __init__(self, hidden, head_dim, num_heads, num_kv_heads, bias=False, tp_rank=0, tp_size=1):
        self.head_dim = head_dim
        self.local_heads = _divide(num_heads, tp_size)
        if not heads_divisible(num_kv_heads, tp_size):
            raise ValueError(f"{num_kv_heads} KV heads neither split over nor replicate "
                             f"across {tp_size} ranks")
        kv_heads = rank_heads(num_kv_heads, tp_size, tp_rank)
        self.local_kv_heads, self.kv_head_start = len(kv_heads), kv_heads[0]
        out = (self.local_heads + 2 * self.local_kv_heads) * head_dim
        ShardedLinear.__init__(self, hidden, out, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard=None):
        q_rows = self.local_heads * self.head_dim
        kv_rows = self.local_kv_heads * self.head_dim
        if shard == "q":
            dst = param.data.narrow(0, 0, q_rows)
            src = loaded.narrow(0, self.tp_rank * q_rows, q_rows)
        else:
            offset = q_rows if shard == "k" else q_rows + kv_rows
            dst = param.data.narrow(0, offset, kv_rows)
            src = loaded.narrow(0, self.kv_head_start * self.head_dim, kv_rows)
        dst.copy_(src)


class RowParallelLinear(ShardedLinear):
    """Input features cut across ranks; partial sums all-reduced; bias added once."""

    def __init__(self, in_features, out_features, bias=False, tp_rank=0, tp_size=1):
        super().__init__(_divide(in_features, tp_size), out_features, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard=None):
        if param.dim() == 1:  # bias: whole on every rank
            param.data.copy_(loaded)
            return
        cols = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x):
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias)
        out = _all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows cut across ranks; rows outside a rank's range come back as zeros and
    the all-reduce fills them in."""

    def __init__(self, vocab: int, hidden: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rows = _divide(vocab, tp_size)
        self.start = tp_rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard=None):
        param.data.copy_(loaded.narrow(0, self.start, self.rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1)
        return _all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over a vocabulary slice; logits gathered to full vocab on every rank."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, logits, group=_TP_GROUP)
        return torch.cat(parts, dim=-1)
