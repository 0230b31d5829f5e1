"""Device probe: bf16 decode rows with the same-traffic copy, then the 2K decode sweep (w2 tiles added)."""
import sys, time
sys.path.insert(0, "scripts"); sys.path.insert(0, "scripts/kernel_bench")
import bench_kernels as BK
from kernel_bench import benchmarks as cases
from kernel_bench.goal_sweep import sweep_decode_short
from kernel_bench.shapes import PAGES
out = sys.argv[1]
args = BK.parse_args(["--out", out, "--budget-s", "1000"] + sys.argv[2:])
run = BK.Run(args)
import torch, triton
info = {"device": "cpu" if run.tiny else torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "argv": ["scratch/decode2k.py"], "started": time.strftime("%Y-%m-%d %H:%M:%S")}
run.info = info
for rep in range(2):
    cases.bench_copy(run)
    cases.bench_decode(run)
for page, ppb in PAGES:
    rows = sweep_decode_short(run, page, ppb, *(([(64, 4, 4)], [1]) if run.tiny else ()))
    ms = run.decode_ms[(40 if run.tiny else 2048, page)]
    base = run.same_copy_ms[min(run.same_copy_ms)]
    for r in sorted(rows, key=lambda r: r["ms"])[:5]:
        print(f"  2K page{page} {r['note']}: {r['ms']} ms, default {ms:.4f}, same-traffic copy {base:.4f} -> {base / r['ms']:.3f}", flush=True)
info["elapsed_s"] = round(time.time() - run.t0, 1)
BK.write_results(__import__("pathlib").Path(out), info, run)
