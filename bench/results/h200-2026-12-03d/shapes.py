"""Device probe: which fp32 products of a drafted step stay on cuBLAS (shapes, CUDA time), eager, then the graph's device time and top kernels."""
import sys
sys.path.insert(0, "scripts")
import torch
import torch.nn.functional as F
from collections import defaultdict
import profile_spec_step as P
from pdflow import SamplingParams
from pdflow.bench.tasks import arith_eval_set
import pdflow.model.layers as L

calls = defaultdict(int)
orig = F.linear
def logged(x, w, b=None):
    if x.is_cuda and x.dtype == torch.float32:
        calls[(x.numel() // x.shape[-1], w.shape[0], x.shape[-1], "F.linear")] += 1
    return orig(x, w, b)
orig_small = None
class A: device = "cuda"; batch = 1; overrides = []; top = 25
prompts = [it.prompt for it in arith_eval_set(1, k_shot=5, seed=11)]
for mode in ("dspark-eager", "dspark"):
    with P._llm(A, mode) as llm:
        for _ in range(2):
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
        if mode == "dspark-eager":
            F.linear = logged
            k = L._small_m_linear()
            orig_small = k.small_m_linear
            def small(x, w, b=None):
                calls[(x.numel() // x.shape[-1], w.shape[0], x.shape[-1], "small_m")] += 1
                return orig_small(x, w, b)
            k.small_m_linear = small
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
            F.linear = orig; k.small_m_linear = orig_small
            for key, n in sorted(calls.items(), key=lambda kv: -kv[1]):
                print("rows N K path:", key, "calls", n, flush=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=40, max_shapes_column_width=70), flush=True)
        else:
            P.graph_time(llm.engine, A)
