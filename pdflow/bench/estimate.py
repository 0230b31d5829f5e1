"""A plan-time estimate of a deployment: the run graph priced with a machine profile.

The graph says what each stage holds (its layers, its TP degree, each side's pool and
block size, the bytes every producer rank writes per block); the profile says what this
machine does per second. A stage's step is its layers times the measured time of one
layer of the rank's TP shard at the step's tokens (the profile's step table, between its
points), plus the LM head and sampling on the last stage; with no table for the model,
shard or thread count (an older profile), the larger of its FLOPs at the rank's GEMM
rate and its bytes at the memory bandwidth (said once). Under TP two all-reduces per
layer; a step adds the pipeline hops, the engine's per-step host overhead and, when the
side has rank processes, one owner <-> rank message and each stage's measured per-step
rank work (its layout's as served where the profile served it), and a prefill step the
layout's measured cost per token. A served request adds its measured serving cost (HTTP, admission, stream) to
its TTFT and to a prefill step per request. On a side with overlap scheduling (one CUDA
rank, no drafter) the host builds the next step while the device runs this one, so a
stream of steps (decode, prefill at load) costs the larger of its host and device work; a
lone step (TTFT at zero load) pays both. Nothing here places or lays out anything:
every shape is asked of the graph.

Goodput: a request of mean prompt ``L`` and output ``O`` needs its TTFT at zero load
within ``slo.ttft_s``; decode runs the largest batch whose time per token stays within
``slo.tpot_s`` and whose blocks fit the decode pool; the rate is the smaller of what
prefill and decode sustain (in series on one instance when monolithic), times
``HEADROOM`` for the queueing an attainment target leaves room for.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field

from pdflow.bench.profile import MachineProfile, layout_key
from pdflow.bench.step_table import ShardTimes, interpolate
from pdflow.graph import CONSUMER, PRODUCER, RunGraph, overlap_scheduling, parallel_of
from pdflow.spec import SloSpec
from pdflow.spec.dtypes import dtype_bytes

HEADROOM = 0.8
# Assumed share of drafts accepted, for tokens per forward before anything was measured.
ASSUMED_ACCEPTANCE = 0.6
PROMPT_LENGTHS = (128, 512, 2048, 8192)
BATCHES = (1, 4, 16, 64, 256)


class EstimateError(ValueError):
    """The profile cannot price this graph (another device kind)."""


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        print(f"pdflow estimate: {message}", file=sys.stderr)


@dataclass(kw_only=True, slots=True)
class Estimate:
    devices: int
    pool_blocks: dict[str, int]
    prefill_tok_s: dict[int, float]  # prompt length -> tokens/s
    ttft_s: dict[int, float]  # prompt length -> seconds at zero load (transfer included)
    decode_step_s: dict[int, float]  # batch -> seconds per step
    decode_tok_s: dict[int, float]  # batch -> output tokens/s
    transfer_s: dict[int, float]  # prompt length -> seconds (P/D only)
    goodput_req_s: float = 0.0
    goodput_per_device: float = 0.0
    decode_batch: int = 0
    input_len: int = 0  # the workload's mean prompt, which est_ttft_s/est_prefill_tok_s price
    limits: list[str] = field(default_factory=list)  # why goodput is what it is (0: why none)

    def to_dict(self) -> dict:
        return asdict(self)

    def metrics(self) -> dict[str, float]:
        """What a run logs beside what it measured (``est_`` prefix)."""
        out = {f"est_{role}_pool_blocks": float(n) for role, n in self.pool_blocks.items()}
        out |= {"est_goodput_req_s": self.goodput_req_s, "est_goodput_per_device": self.goodput_per_device,
                "est_decode_batch": float(self.decode_batch)}
        if self.input_len in self.ttft_s:
            out |= {"est_ttft_s": self.ttft_s[self.input_len], "est_prefill_tok_s": self.prefill_tok_s[self.input_len]}
        return out


@dataclass(kw_only=True, slots=True)
class Pricer:
    """Step times of one side of the graph on one profile."""

    graph: RunGraph
    profile: MachineProfile
    role: str

    def __post_init__(self) -> None:
        device = self.par.device
        kind = "cpu" if device == "cpu" else "cuda"
        if kind != self.profile.device:
            raise EstimateError(f"the profile measured {self.profile.device}, the {self.role} side runs on {device}; "
                                f"run pdflow profile --device {kind} --out FILE and pass --profile FILE")

    @property
    def par(self):
        return parallel_of(self.graph.spec, self.role)

    def threads(self) -> int:
        """Torch threads a rank of this side gets (``pdflow.worker.rank_loop``'s share)."""
        inst = self.graph.instance(self.role)
        return max(1, self.profile.cores // (inst.tp * inst.pp))

    def shard(self) -> ShardTimes | None:
        """The step table's times for this side's TP shard and thread count (None: not
        measured, and the GEMM model prices it)."""
        prof, model, inst = self.profile, self.graph.spec.model, self.graph.instance(self.role)
        table = prof.step_table(model)
        shard = table.shard(inst.tp, self.threads()) if table else None
        if shard is None:
            _say_once("the profile has no step table (an older file): pricing by the GEMM rate; rerun pdflow profile"
                      if not prof.step_tables else
                      f"no step table for {model.name} tp{inst.tp} at {self.threads()} threads in the profile: "
                      f"pricing by the GEMM rate (pdflow profile --model {model.name} --tp {inst.tp})")
        return shard

    def _stage_s(self, stage, tokens: int, context: int, rows: int) -> float:
        m, par, prof = self.graph.spec.model, self.par, self.profile
        inst = self.graph.instance(self.role)
        layers = stage.layer_stop - stage.layer_start
        threads = self.threads()
        # CPU ranks beyond the cores take turns: a stage's TP ranks all compute at once.
        crowd = max(1.0, inst.tp * threads / prof.cores) if prof.device == "cpu" else 1.0
        shard = self.shard()
        if shard is not None:
            compute = layers * shard.layer_s(tokens, rows, context)
            if stage.index == inst.pp - 1:
                compute += interpolate(shard.head_s, max(1, rows))
            return crowd * compute + self._collectives_s(layers, tokens)
        matmul = (m.params_per_layer() - 2 * m.hidden) * layers
        flops = 2.0 * tokens * matmul / inst.tp
        flops += 4.0 * m.heads * m.head_dim * tokens * context * layers / inst.tp
        weight_bytes = matmul * dtype_bytes(m.stored_weight_dtype) / inst.tp
        kv_bytes = self.graph.budgets[self.role].stages[stage.index].bytes_per_block * context \
            / max(1, par.block_size) * max(1, rows)
        if stage.index == inst.pp - 1:
            flops += 2.0 * rows * m.vocab * m.hidden
            weight_bytes += m.vocab * m.hidden * dtype_bytes(m.stored_weight_dtype)
        compute = crowd * max(flops / prof.rank_flops_s(threads, m.hidden),
                              (weight_bytes + kv_bytes) / prof.mem_bytes_s)
        return compute + self._collectives_s(layers, tokens)

    def _collectives_s(self, layers: int, tokens: int) -> float:
        """Two all-reduces of the step's activations per layer under TP."""
        m = self.graph.spec.model
        if self.graph.instance(self.role).tp == 1:
            return 0.0
        act = tokens * m.hidden * dtype_bytes(m.dtype)
        return 2 * layers * (self._all_reduce_s() + act / self._link_rate())

    def _all_reduce_s(self) -> float:
        """The profile's measured all-reduce; older profiles: the link's latency."""
        return self.profile.allreduce_s or self._link_latency()

    def _hop_s(self) -> float:
        return self.profile.hop_s or self._link_latency()

    def _link_latency(self) -> float:
        return self.profile.transfer_latency_s.get("nccl" if self.profile.device == "cuda" else "gloo", 0.0)

    def _link_rate(self) -> float:
        return self.profile.transfer_bytes_s.get("nccl" if self.profile.device == "cuda" else "gloo", math.inf)

    def stage_times(self, tokens: int, context: int, rows: int) -> list[float]:
        return [self._stage_s(s, tokens, context, rows) for s in self.graph.instance(self.role).stages]

    def overhead_s(self) -> float:
        inst = self.graph.instance(self.role)
        prof = self.profile
        hops = (inst.pp - 1) * self._hop_s()
        by_table = self.shard() is not None  # its overheads were measured against the table
        ranks = 0.0
        if inst.tp * inst.pp > 1:  # rank processes: a message each way, each stage's own step work
            crowd = max(1.0, inst.tp / prof.cores) if prof.device == "cpu" else 1.0
            rank_step = prof.table_rank_step_overhead_s if by_table else prof.rank_step_overhead_s
            if by_table and self.layout() in prof.table_rank_step_by_layout:  # this layout served
                crowd, rank_step = 1.0, prof.table_rank_step_by_layout[self.layout()]
            ranks = prof.rank_message_s + inst.pp * crowd * rank_step
        return (prof.table_step_overhead_s if by_table else prof.step_overhead_s) + ranks + hops

    def layout(self) -> str:
        """The profile's key for this side's rank layout."""
        inst = self.graph.instance(self.role)
        return layout_key(inst.tp, inst.pp)

    def prefill_token_s(self) -> float:
        """A prefill step's cost per token beyond its priced compute where this side's
        layout was served with rank processes (0: one rank, or the layout not served;
        below 0: the layout sustained more than priced, in throughput, not in a lone
        prompt's latency)."""
        inst = self.graph.instance(self.role)
        if inst.tp * inst.pp == 1 or self.shard() is None:
            return 0.0
        return self.profile.rank_prefill_token_s_by_layout.get(self.layout(), 0.0)

    def exchange_request_s(self) -> float:
        """A P/D request's exchange at this graph's rank pairs that move its KV: linear
        in the pairs through the counts served (``exchange_request_by_pairs``; the last
        segment's slope beyond them, the first's before), >= 0; the tp1 -> tp1 figure
        where only that was served."""
        by = {int(k): v for k, v in self.profile.exchange_request_by_pairs.items()}
        if len(by) < 2:
            return next(iter(by.values()), self.profile.exchange_request_s)
        n, pairs = self.graph.kv_pairs, sorted(by)
        hi = next((p for p in pairs[1:] if p >= n), pairs[-1])
        lo = pairs[pairs.index(hi) - 1]
        return max(0.0, by[lo] + (by[hi] - by[lo]) * (n - lo) / (hi - lo))

    def overlapped(self) -> bool:
        """Whether this side runs overlap scheduling (``pdflow.graph.overlap``): in a stream
        of steps the host builds the next while the device runs this one."""
        return overlap_scheduling(self.graph.spec, self.role)

    def host_s(self, rows: int) -> float:
        """A step's host work: the engine's step overhead (and, table-priced without rank
        processes, each row's beyond the first; with rank processes the owner's per-row
        work overlaps their compute: measured, 4 streams cost no more than 1 under TP2)."""
        inst = self.graph.instance(self.role)
        in_process = inst.tp * inst.pp == 1 and self.shard() is not None
        return self.overhead_s() + ((max(1, rows) - 1) * self.profile.table_row_overhead_s if in_process else 0.0)

    def step_s(self, tokens: int, context: int, rows: int, *, stream: bool = False) -> float:
        """One step: its host work, then every stage in turn. ``stream``: a step among
        others (decode, a prefill at load), where an overlapped side's host work hides
        behind the device's (the larger of the two); a lone step pays both."""
        device = sum(self.stage_times(tokens, context, rows))
        if stream and self.overlapped():
            return max(self.host_s(rows), device)
        return self.host_s(rows) + device

    def depth(self, batch: int) -> int:
        """Decode steps in flight at once: the engine splits a batch across up to one step
        per PP stage (on CPU only as far as spare cores let stages overlap)."""
        inst = self.graph.instance(self.role)
        depth = min(self.par.steps_in_flight, inst.pp, batch)
        if self.profile.device == "cpu":
            depth = min(depth, max(1, self.profile.cores // inst.tp))
        return max(1, depth)

    def prefill(self, length: int, concurrent: int = 1) -> tuple[float, float]:
        """(seconds for one prompt alone, tokens/s with ``concurrent`` prompts batched
        up to ``max_num_batched_tokens`` a step and the pipeline full of steps)."""
        chunk = min(length, self.par.max_num_batched_tokens)
        chunks = math.ceil(length / chunk)
        # a served request's own cost, same cores, and the part that grows with its prompt
        request = self.profile.request_overhead_s + length * self.profile.request_overhead_per_token_s
        if self.role == PRODUCER:  # P/D: the request's exchange between the instances too
            request += self.exchange_request_s() + length * self.profile.exchange_token_s
        alone = request + length * max(0.0, self.prefill_token_s()) + sum(self.step_s(chunk, min(length, (i + 1) * chunk) // 2 + 1, 1) for i in range(chunks))
        tokens = min(length * max(1, concurrent), self.par.max_num_batched_tokens)
        rows = max(1, tokens // length)
        stages = self.stage_times(tokens, chunk // 2 + 1, rows)
        if self.overlapped():  # the requests' host work, with the step's, behind the device's
            return alone, tokens / max(self.host_s(rows) + rows * request, sum(stages))
        depth = self.depth(self.graph.instance(self.role).pp)
        per_step = (max((self.host_s(rows) + sum(stages)) / depth, max(stages)) + rows * request
                    + tokens * self.prefill_token_s())
        per_step = max(per_step, max(stages))  # a layout's gain stops at its busiest stage's compute
        return alone, tokens / per_step


def devices_of(graph: RunGraph) -> int:
    """Devices the deployment holds: a rank each, on every side it runs."""
    roles = (CONSUMER,) if graph.producer is None else (PRODUCER, CONSUMER)
    return sum(graph.instance(r).tp * graph.instance(r).pp for r in roles)


def transfer_s(graph: RunGraph, profile: MachineProfile, length: int) -> float:
    """The busiest producer rank's bytes for a ``length``-token prompt at the profile's
    rate for the graph's transfer (ranks write in parallel)."""
    if graph.producer is None or not graph.cuts:
        return 0.0
    blocks = math.ceil(length / graph.spec.prefill.block_size)
    per_rank: dict[int, int] = {}
    for cut in graph.cuts:
        per_rank[cut.producer_rank] = per_rank.get(cut.producer_rank, 0) + cut.bytes_per_block
    backend = next((b for b in profile.transfer_bytes_s if graph.transfer.startswith(b)), "mooncake")
    rate = profile.transfer_bytes_s.get(backend, math.inf)
    latency = profile.transfer_latency_s.get(backend, 0.0)
    return latency + blocks * max(per_rank.values()) / rate


def tokens_per_forward(graph: RunGraph, acceptance: float = ASSUMED_ACCEPTANCE) -> float:
    k = graph.spec.drafter.num_speculative_tokens if graph.drafter is not None else 0
    return 1.0 + sum(acceptance ** i for i in range(1, k + 1))


def workload_shape(spec) -> tuple[int, int]:
    """(prompt, output) lengths the workload sends on average: what the estimate prices."""
    w = spec.workload
    if w.kind == "serve":
        return sum(w.input_len) // 2, max(1, sum(w.output_len) // 2)
    if w.kind == "prefill":
        return w.prompt_tokens, 1
    return 256, 64


def estimate_run(graph: RunGraph, profile: MachineProfile) -> Estimate:
    """The estimate for the run's own workload and SLOs."""
    length, output = workload_shape(graph.spec)
    return estimate(graph, profile, slo=graph.spec.workload.slo, input_len=length, output_len=output)


def render(est: Estimate) -> str:
    """Plain-text tables for ``pdflow plan --estimate``."""
    lines = [f"estimate ({est.devices} devices; pools: "
             + ", ".join(f"{r} {n} blocks" for r, n in est.pool_blocks.items()) + ")",
             "  prompt  prefill tok/s   TTFT s   transfer s"]
    for n in est.prefill_tok_s:
        lines.append(f"  {n:6d}  {est.prefill_tok_s[n]:13.4g}  {est.ttft_s[n]:7.3g}  "
                     f"{est.transfer_s.get(n, 0.0):11.3g}")
    lines.append("  batch   step s   decode tok/s")
    lines += [f"  {b:5d}  {est.decode_step_s[b]:7.3g}  {est.decode_tok_s[b]:13.4g}" for b in est.decode_step_s]
    lines.append(f"goodput {est.goodput_req_s:.3g} req/s ({est.goodput_per_device:.3g} per device, decode batch "
                 f"{est.decode_batch}): {'; '.join(est.limits)}")
    return "\n".join(lines)


def estimate(graph: RunGraph, profile: MachineProfile, *, slo: SloSpec | None = None,
             input_len: int = 256, output_len: int = 64) -> Estimate:
    spec = graph.spec
    decode = Pricer(graph=graph, profile=profile, role=CONSUMER)
    prefill = decode if graph.producer is None else Pricer(graph=graph, profile=profile, role=PRODUCER)
    k = spec.drafter.num_speculative_tokens if graph.drafter is not None else 0
    tpf = tokens_per_forward(graph)
    lengths = [n for n in PROMPT_LENGTHS if n <= spec.model.max_model_len] or [spec.model.max_model_len]
    lengths = sorted(set(lengths) | {input_len})
    ttft, rate, moved = {}, {}, {}
    for n in lengths:
        alone, rate[n] = prefill.prefill(n)
        moved[n] = transfer_s(graph, profile, n)
        ttft[n] = alone + moved[n]
    batches = sorted({b for b in BATCHES if b <= spec.decode.max_num_seqs} | {1})
    context = input_len + output_len // 2
    step = {b: decode.step_s(b * (k + 1), context, b, stream=True) for b in batches}
    out = Estimate(
        devices=devices_of(graph),
        pool_blocks={role: b.pool_blocks for role, b in graph.budgets.items()},
        prefill_tok_s=rate, ttft_s=ttft, decode_step_s=step,
        decode_tok_s={b: b * tpf * decode.depth(b) / s for b, s in step.items()},
        transfer_s=moved if graph.producer else {},
        input_len=input_len,
    )
    _goodput(out, graph, decode, prefill, slo or SloSpec(), input_len, output_len, k, tpf)
    return out


def _goodput(out: Estimate, graph: RunGraph, decode: Pricer, prefill: Pricer, slo: SloSpec,
             length: int, output: int, k: int, tpf: float) -> None:
    spec = graph.spec
    if slo.ttft_s is not None and out.ttft_s[length] > slo.ttft_s:
        out.limits.append(f"TTFT at zero load {out.ttft_s[length]:.3g}s > slo.ttft_s {slo.ttft_s}")
        return
    budget = graph.budgets[CONSUMER]
    per_request = math.ceil((length + output + k) / max(1, budget.block_size))
    fit = min(spec.decode.max_num_seqs, budget.pool_blocks // max(1, per_request))
    context = length + output // 2
    best, best_tpot = 0, 0.0
    for b in range(1, fit + 1):
        tpot = decode.step_s(b * (k + 1), context, b, stream=True) / tpf
        if slo.tpot_s is not None and tpot > slo.tpot_s:
            break
        best, best_tpot = b, tpot
    if best == 0:
        out.limits.append("no decode batch fits the pool and slo.tpot_s" if fit else
                          f"the decode pool ({budget.pool_blocks} blocks) cannot hold one request")
        return
    decode_rate = best * decode.depth(best) / (output * best_tpot)
    _, tok_s = prefill.prefill(length)
    prefill_rate = tok_s / length
    if graph.producer is None:
        rate = 1.0 / (1.0 / prefill_rate + 1.0 / decode_rate)
        out.limits.append("prefill and decode share the instance")
    else:
        rate = min(prefill_rate, decode_rate)
        out.limits.append("prefill-bound" if prefill_rate < decode_rate else "decode-bound")
    out.decode_batch = best
    out.goodput_req_s = HEADROOM * rate
    out.goodput_per_device = out.goodput_req_s / out.devices
