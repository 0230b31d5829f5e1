"""Times pdflow's own decoder layer, LM head and sampling for ``pdflow profile``'s step
table (``step_table``): random weights of the spec's model geometry on this device, one
layer of the rank that holds the last layer (tp rank 0, heads and MLP split as the graph
splits them, its KV units laid out by the graph), with the torch thread count a rank gets
when the deployment's ranks share the cores.

What it leaves out, priced elsewhere by the estimate: the TP all-reduces (a one-process
group of one rank stands in, so ``RowParallelLinear`` runs as served) and the logits'
all-gather (the head times the rank's vocabulary slice, then samples the full width).
"""

from __future__ import annotations

import contextlib
import math

from pdflow.bench.step_table import ShardTimes, StepTable, geometry_of

CPU_POINTS = {"prefill": (16, 64, 256, 1024, 2048), "batches": (1, 4, 16, 64), "contexts": (32, 512)}
GPU_POINTS = {"prefill": (16, 128, 512, 2048, 8192), "batches": (1, 4, 16, 64, 256), "contexts": (128, 2048)}
# Thread counts a rank of a tp x pp deployment gets: the searched depths.
PIPELINE_DEPTHS = (1, 2, 4)


def shard_plan(tps: tuple[int, ...], cores: int, device: str) -> list[tuple[int, int]]:
    """(tp, threads) to time: each TP degree at the thread count ``cores // (tp * pp)``
    (``pdflow.worker.rank_loop``'s share) for each searched pp; one each on a GPU."""
    if device != "cpu":
        return [(tp, 1) for tp in tps]
    return sorted({(tp, max(1, cores // (tp * pp))) for tp in tps for pp in PIPELINE_DEPTHS})


def points_within(points: dict, max_model_len: int) -> dict:
    """The token counts a model can hold: past its positions RoPE's table has no row (on a
    GPU the fused kernel reads out of bounds; the tiny model holds 4096, GPU_POINTS go to 8192)."""
    fits = {k: tuple(t for t in v if k == "batches" or t <= max_model_len) for k, v in points.items()}
    return {k: v or (max_model_len,) for k, v in fits.items()}


@contextlib.contextmanager
def _one_rank_group(device: str):
    """A process group of this process alone, so a TP shard's row-parallel layers run
    their all-reduce as served (over one rank: the data stays put)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo" if device == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure_step_table(model_overrides: list[str], device: str, tps: tuple[int, ...], cores: int,
                       timed) -> StepTable:
    """The table for the model ``model_overrides`` compose (random weights); ``timed(fn,
    sync=...)``: seconds per call (``pdflow.bench.profile._timed``)."""
    import torch

    from pdflow.spec.load import compose_spec

    spec = compose_spec([*model_overrides, "model.path=null", "mode=monolithic", "drafter=none", "tracking=off"])
    points = points_within(CPU_POINTS if device == "cpu" else GPU_POINTS, spec.model.max_model_len)
    shards = []
    threads_before = torch.get_num_threads()
    with _one_rank_group(device) if max(tps) > 1 else contextlib.nullcontext():
        for tp, threads in shard_plan(tps, cores, device):
            if device == "cpu":
                torch.set_num_threads(threads)
            try:
                shards.append(_time_shard(model_overrides, device, tp, threads, points, timed))
            finally:
                torch.set_num_threads(threads_before)
    return StepTable(model=spec.model.name, geometry=geometry_of(spec.model, device), shards=shards)


def _time_shard(model_overrides, device: str, tp: int, threads: int, points: dict, timed) -> ShardTimes:
    import torch

    from pdflow.attention.backends import get_backend
    from pdflow.attention.kv_cache import TORCH_DTYPES, KVCacheBinding
    from pdflow.graph import CONSUMER, build_graph, parallel_of
    from pdflow.model.loader import build_model, model_config
    from pdflow.spec.load import compose_spec

    spec = compose_spec([*model_overrides, "model.path=null", "mode=monolithic", f"decode=tp{tp}", "drafter=none",
                         "tracking=off", f"decode.device={device}", f"prefill.device={device}"])
    graph = build_graph(spec)
    par, last = parallel_of(spec, CONSUMER), spec.model.layers - 1
    me = next(r for r in graph.instance(CONSUMER).ranks if r.tp_rank == 0 and last in
              graph.instance(CONSUMER).stages[r.stage].layers)
    _, cfg = model_config(spec.model)
    dev = torch.device("cuda", torch.cuda.current_device()) if device.startswith("cuda") else torch.device("cpu")
    model = build_model(cfg, folder=None, dtype=TORCH_DTYPES[spec.model.dtype], device=dev,
                        layer_range=range(last, last + 1), tp_rank=0, tp_size=tp, seed=spec.seed)
    bs = par.block_size
    longest = max(max(points["prefill"]), max(points["batches"]) * bs * math.ceil(max(points["contexts"]) / bs))
    kv = KVCacheBinding([u for u in me.target_units if u.layer == last], longest // bs + 1, dev)
    kv.bind(model.attention_layers(), get_backend(par.attention_backend))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    layer = model.model.layers[str(last)]
    fused = model.uses_fused_kernels(torch.empty(1, device=dev, dtype=TORCH_DTYPES[spec.model.dtype]))
    dtype = TORCH_DTYPES[spec.model.dtype]

    def timed_s(fn) -> float:
        with torch.inference_mode():
            return timed(fn, sync=sync, min_s=0.2, rounds=4)

    def hidden(tokens: int):
        x = torch.randn(tokens, cfg.hidden_size, device=dev, dtype=dtype) * 0.02
        return x, torch.randn_like(x)

    def dense_pieces(tokens: int):
        """The layer less its attention op (norms, projections, RoPE, MLP) as the served
        prefill runs it: on a GPU graphed in pieces around the attention."""
        (x, residual), positions = hidden(tokens), torch.arange(tokens, device=dev)
        slots = torch.arange(tokens, device=dev)
        attn = layer.self_attn
        out = torch.randn(tokens, attn.num_heads, attn.head_dim, device=dev, dtype=dtype)
        with torch.inference_mode():
            return graphed(lambda: (layer.before_attention(x, residual, positions, slots, fused),
                                    layer.after_attention(out, residual, fused)), dev)

    def prefill_s(tokens: int) -> tuple[float, float]:
        """(dense, attention) seconds of one prefill layer of ``tokens`` tokens, KV store
        included. On a GPU the attention is what it adds to the graphed pieces when launched
        between them, as served: its host launch cost (~0.2 ms on the H200's host) overlaps
        the pieces' device time. Each timed apart and summed, a Qwen3-0.6B prefill was
        priced at 0.36x the served rate: the launches were counted, not overlapped."""
        pieces = dense_pieces(tokens)
        attn = layer.self_attn
        q = torch.randn(tokens, attn.num_heads, attn.head_dim, device=dev, dtype=dtype)
        k = torch.randn(tokens, attn.num_kv_heads, attn.head_dim, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        meta = _prefill_meta(tokens, bs, dev)
        dense = timed_s(pieces)
        if dev.type != "cuda":
            return dense, timed_s(lambda: attn.attn(q, k, v, meta))
        return dense, max(0.0, timed_s(lambda: (pieces(), attn.attn(q, k, v, meta))) - dense)

    def layer_s(meta, positions) -> float:
        x, residual = hidden(positions.numel())
        with torch.inference_mode():
            return timed_s(graphed(lambda: layer(x, residual, positions, meta, fused), dev))

    prefill = {t: prefill_s(t) for t in points["prefill"]}
    dense = {t: d for t, (d, _) in prefill.items()}
    attention = {t: a for t, (_, a) in prefill.items()}
    decode = {c: {b: layer_s(*_decode_meta(b, c, bs, dev)) for b in points["batches"]} for c in points["contexts"]}
    head = {r: _head_s(model, r, tp, cfg, dev, dtype, fused, sync, timed) for r in points["batches"]}
    return ShardTimes(tp=tp, threads=threads, dense_s=dense, prefill_attention_s=attention, decode_s=decode,
                      head_s=head)


def graphed(fn, dev):
    """``fn`` as the served engine runs it: on a GPU one CUDA graph capture, then replays
    (timed eagerly, a Qwen3-0.6B decode layer priced its kernel launches, ~1 ms, and the
    estimate came out 20x below the served decode); on a CPU ``fn`` itself."""
    import torch

    if dev.type != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # Triton compiles and autotunes outside the capture
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as err:  # priced eagerly, and said so: the table is then high
        print(f"pdflow profile: a step piece did not capture ({err}); timed eagerly", flush=True)
        return fn

    def replay():
        """The graph reads and writes the tensors ``fn`` closes over: holding ``fn`` keeps
        them from the allocator (freed, a replay wrote KV at slots that were now another
        tensor's floats: an illegal address on the H200)."""
        graph.replay()
        return fn

    return replay


def _prefill_meta(tokens: int, bs: int, dev):
    """One sequence of ``tokens`` new tokens from position 0, in blocks 0, 1, ..."""
    import torch

    from pdflow.attention.metadata import AttentionMetadata

    blocks = math.ceil(tokens / bs)
    return AttentionMetadata(
        decode_only=False, slot_mapping=torch.arange(tokens, device=dev),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
        context_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None], max_seqlen_q=tokens)


def _decode_meta(batch: int, context: int, bs: int, dev):
    """``batch`` sequences of ``context`` tokens, each bringing its last one."""
    import torch

    from pdflow.attention.metadata import AttentionMetadata

    per = math.ceil(context / bs)
    tables = torch.arange(batch * per, dtype=torch.int32, device=dev).view(batch, per)
    pos = context - 1
    slots = tables[:, pos // bs].long() * bs + pos % bs
    meta = AttentionMetadata(
        decode_only=True, slot_mapping=slots, cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=dev), block_tables=tables,
        max_seqlen_q=1)
    return meta, torch.full((batch,), pos, device=dev)


def _head_s(model, rows: int, tp: int, cfg, dev, dtype, fused: bool, sync, timed) -> float:
    """Final norm, this rank's slice of the LM head, greedy sampling over the full
    vocabulary (the slices side by side stand in for the gathered logits)."""
    import torch

    from pdflow.model.layers import linear
    from pdflow.parallel.messages import SamplingSpec
    from pdflow.worker.sampler import Sampler

    x = torch.randn(rows, cfg.hidden_size, device=dev, dtype=dtype) * 0.02
    residual = torch.randn_like(x)
    sampler, params, gens = Sampler(), [SamplingSpec()] * rows, [None] * rows

    def head():
        hidden = model.model.norm(x, residual, fused=fused)[0]
        logits = linear(hidden, model.lm_head.weight)  # as served (small fp32 CUDA rows: small_m)
        return sampler(logits.repeat(1, tp) if tp > 1 else logits, params, gens)

    with torch.inference_mode():
        return timed(head, sync=sync, min_s=0.2, rounds=4)
