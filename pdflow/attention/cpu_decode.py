"""A fused paged decode-attention op for CPU, fp32, built on first use.

Why: the eager path gathers every sequence's K/V into a buffer and reads it back in the
matmuls, so the KV pool crosses memory three times per layer and pushes the weights out
of L3. This op walks each sequence's pages in place (one pass over K for the scores,
one over V for the output, one (sequence, KV head) pair per task on torch's intra-op
threads) and writes only the [B, H_q, D] result.

Built with ``torch.utils.cpp_extension.load_inline`` on first use (gcc, ~1 min once,
announced on stderr; cached under ``~/.cache/torch_extensions`` or
``TORCH_EXTENSIONS_DIR``, in a folder per torch install, see ``jit_build``; the module
name carries a hash of the source, flags and CPU so a shared cache never serves code
built for another CPU). Set ``PDFLOW_CPU_KERNELS=0`` to skip it; any build failure also
falls back (``op()`` is None) to the eager torch path.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from pathlib import Path

import torch

from pdflow.attention import jit_build

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// DC: head_dim known at compile time (vectorised fully), or 0 for any head_dim.
template <int64_t DC>
static void run(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                const torch::Tensor& lens, const torch::Tensor& tables, double scale,
                torch::Tensor& out) {
  const int64_t B = q.size(0), HQ = q.size(1), D = DC ? DC : q.size(2);
  const int64_t PPB = kc.size(1), HKV = kc.size(2), PAGE = kc.size(3);
  const int64_t G = HQ / HKV, BS = PPB * PAGE, W = tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * HKV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, acc(G * D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / HKV, h = w % HKV, n = lp[b];
      const float* qb = qp + (b * HQ + h * G) * D;
      auto row = [&](const float* cache, int64_t t) {
        const int64_t blk = tp[b * W + t / BS], off = t % BS;
        return cache + (((blk * PPB + off / PAGE) * HKV + h) * PAGE + off % PAGE) * D;
      };
      s.resize(G * n);
      for (int64_t t = 0; t < n; ++t) {
        const float* kr = row(kp, t);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * kr[d];
          s[g * n + t] = dot * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * n;
        float m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; ++t) m = std::max(m, sg[t]);
        for (int64_t t = 0; t < n; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = n ? 1.f / sum : 0.f;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const float* vr = row(vp, t);
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * n + t];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vr[d];
        }
      }
      std::copy(acc.begin(), acc.end(), op + (b * HQ + h * G) * D);
    }
  });
}

// The pages are read through raw pointers: metadata that does not match the tensors (a
// prefill's rows, a table too short for a length, a block past the pool) must raise here,
// not read out of bounds.
static void check(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                  const torch::Tensor& lens, const torch::Tensor& tables) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 5 && vc.sizes() == kc.sizes() && q.size(2) == kc.size(4),
              "paged_decode: q [B, H_q, D] and caches [blocks, pages, H_kv, page, D] expected");
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), "paged_decode: contiguous tensors expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
              "paged_decode: fp32 q and caches expected");
  TORCH_CHECK(lens.scalar_type() == at::kInt && tables.scalar_type() == at::kInt && tables.dim() == 2
              && lens.is_contiguous() && tables.is_contiguous(), "paged_decode: int32 lengths and tables expected");
  const int64_t B = q.size(0), NB = kc.size(0), BS = kc.size(1) * kc.size(3), W = tables.size(1);
  TORCH_CHECK(lens.numel() == B && tables.size(0) == B, "paged_decode: ", B, " rows of q but ", lens.numel(),
              " lengths and ", tables.size(0), " block-table rows (one new token per sequence)");
  TORCH_CHECK(kc.size(2) > 0 && q.size(1) % kc.size(2) == 0, "paged_decode: H_q not a multiple of H_kv");
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= W * BS, "paged_decode: sequence ", b, " has length ", lp[b],
                " but its table holds ", W * BS, " tokens");
    for (int64_t i = 0; i < (lp[b] + BS - 1) / BS; ++i)
      TORCH_CHECK(tp[b * W + i] >= 0 && tp[b * W + i] < NB, "paged_decode: sequence ", b, " names block ",
                  tp[b * W + i], " of a pool of ", NB);
  }
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc,
                           torch::Tensor lens, torch::Tensor tables, double scale) {
  check(q, kc, vc, lens, tables);
  auto out = torch::empty_like(q);
  switch (q.size(2)) {
    case 64: run<64>(q, kc, vc, lens, tables, scale, out); break;
    case 128: run<128>(q, kc, vc, lens, tables, scale, out); break;
    default: run<0>(q, kc, vc, lens, tables, scale, out);
  }
  return out;
}
"""

# -ffast-math lets gcc vectorise the dot-product reductions and exp; only positions
# below each length are read, so no inf/NaN reaches them.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_op = None
_tried = False


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        info = platform.processor()
    return info


def module_name() -> str:
    key = hashlib.sha1((_SOURCE + " ".join(_FLAGS) + torch.__version__ + _cpu_tag())
                       .encode()).hexdigest()[:12]
    return f"pdflow_cpu_decode_{key}"


def build_folder() -> Path:
    """Where this torch install builds the op (read at call time: TORCH_EXTENSIONS_DIR)."""
    return jit_build.build_directory(module_name())


def enabled() -> bool:
    """Whether the op is wanted (``PDFLOW_CPU_KERNELS=0`` turns it off)."""
    return os.environ.get("PDFLOW_CPU_KERNELS", "1") != "0"


def op():
    """The compiled op, or None (disabled, no compiler, or a build elsewhere that never
    finishes): callers fall back."""
    global _op, _tried
    if not _tried:
        _tried = True
        if enabled():
            try:
                _op = jit_build.load_inline_op(
                    module_name(), folder=build_folder(), what="the CPU decode op",
                    source=_SOURCE, functions=["paged_decode"], cflags=_FLAGS,
                    ldflags=["-fopenmp"],
                ).paged_decode
            except Exception as err:  # no compiler, headers, ...: the eager path still works
                warnings.warn(f"pdflow CPU decode kernel unavailable, using eager torch: {err}",
                              stacklevel=2)
    return _op


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """fp32 on CPU with contiguous caches: what the op handles."""
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q.shape[1] % k_cache.shape[2] == 0 and op() is not None)


def decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale) -> torch.Tensor:
    return _op(q.contiguous(), k_cache, v_cache,
               context_lens.to(torch.int32).contiguous(),
               block_tables.to(torch.int32).contiguous(), float(scale))
