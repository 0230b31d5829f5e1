"""CPU probe (issue 33): a short chunk after a cached prefix, as decode rows vs as one prefill, torch backend, the tiny model's heads; one thread. Run from the repo root."""
import time, torch, sys
sys.path.insert(0, "tests")
from pdflow.attention.backends import get_backend
from pdflow.parallel.messages import SamplingSpec, StepInput
from pdflow.worker import stage_runner
from pdflow.worker.stage_runner import StageRunner
torch.set_num_threads(1)
BLOCK, H_Q, H_KV, D = 16, 8, 4, 64
def step(n, start):
    table = list(range((start + n + BLOCK - 1) // BLOCK))
    return StepInput(step=0, seq_ids=["s"], token_ids=[5]*n, positions=list(range(start, start+n)),
        slot_mapping=[table[p // BLOCK]*BLOCK + p % BLOCK for p in range(start, start+n)], cu_seqlens_q=[0, n],
        context_lens=[start+n], block_tables=[table], sample_rows=[], sample_seq_ids=[], sampling=[SamplingSpec()])
be = get_backend("torch")
for n, start in ((32, 128), (64, 256), (88, 300)):
    st = step(n, start)
    runner = StageRunner(model=None, device=torch.device("cpu"))
    rows = runner._rows_as_decode(st, [n])  # what a GPU runner takes
    stage_runner.SHORT_STEP_ROWS = 0
    _, _, chunk = runner.tensors(st)
    stage_runner.SHORT_STEP_ROWS = 128
    nb = 64
    kc = torch.randn(nb, 1, H_KV, BLOCK, D); vc = torch.randn_like(kc)
    q = torch.randn(n, H_Q, D)
    def t(fn, reps=200):
        fn(); t0 = time.perf_counter()
        for _ in range(reps): fn()
        return (time.perf_counter() - t0) / reps * 1e3
    a = t(lambda: be.decode_attention(q, kc, vc, rows.context_lens, rows.block_tables, 0.125))
    b = t(lambda: be.prefill_attention(q, kc, vc, chunk.cu_seqlens_q, chunk.context_lens, chunk.block_tables, 0.125, max_seqlen_q=chunk.max_seqlen_q))
    print(f"{n} rows after {start}: rows-as-decode {a:.3f} ms/layer, prefill op {b:.3f} ms/layer")
