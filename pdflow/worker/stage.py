"""One rank's stage: model slice + KV binding + backend + runner, built in one place.

``build_stage`` is what the one-process path and every rank of a TP/PP instance call, so
both run the same code (CUDA-graph decode included). Everything it places (layers, heads,
units, taps, block count) it asks the run graph.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdflow.attention.backends import get_backend
from pdflow.attention.kv_cache import TORCH_DTYPES, KVCacheBinding
from pdflow.graph import RankPlan, RunGraph, parallel_of
from pdflow.model.config import DecoderConfig
from pdflow.model.decoder import CausalLM
from pdflow.model.loader import build_model, model_config
from pdflow.parallel.messages import KVExport, KVSent, PromptLogprobs, StepInput, StepOutput
from pdflow.spec import ParallelSpec
from pdflow.spec_decode import duties
from pdflow.worker.cuda_graphs import DecodeGraphRunner, graphs_supported
from pdflow.worker.drafted_graphs import DraftedGraphRunner
from pdflow.worker.drafter_build import build_rank_drafter
from pdflow.worker.drafting import DraftedStep, Drafting
from pdflow.worker.kv_link import KVLink
from pdflow.worker.kv_sender import KVSender
from pdflow.worker.logprobs import score_prompts
from pdflow.worker.piecewise_graphs import PiecewiseGraphRunner, piecewise_supported
from pdflow.worker.stage_runner import ROWS_AS_DECODE, StageRunner
from pdflow.worker.warm_up import warm_up

# New tokens of the largest warm-up step: enough to take the kernels' prefill paths.
WARM_UP_TOKENS = 512
# Rows the decode graphs capture at most when steps verify drafts (one decode row per
# token, stage_runner.ROWS_AS_DECODE): a batch of 64 at k=7; larger verifies run eagerly.
MAX_GRAPH_ROWS = 512


def decode_graph_rows(max_num_seqs: int, lookahead: int, max_num_batched_tokens: int) -> int:
    """Rows the decode graphs must take: one per sequence, or k+1 per sequence on a side
    that verifies k drafts a step (its verify runs as decode rows), capped by the step's
    token budget and MAX_GRAPH_ROWS (never below one row per sequence)."""
    if not lookahead:
        return max_num_seqs
    rows = min(max_num_seqs * (lookahead + 1), max_num_batched_tokens, MAX_GRAPH_ROWS)
    return max(rows, max_num_seqs)


def rank_device(par: ParallelSpec, me: RankPlan) -> torch.device:
    """The device the graph placed ``me`` on: GPU ``me.device_index`` under CUDA."""
    if par.device != "cuda":
        return torch.device(par.device)
    count = torch.cuda.device_count()
    if me.device_index >= count:
        raise RuntimeError(
            f"rank {me.label} is placed on GPU {me.device_index} but this host has {count}; "
            f"set {me.role}.device_offset (or use fewer ranks) to fit the run on its GPUs"
        )
    return torch.device("cuda", me.device_index)


def served_max_model_len(graph: RunGraph, role: str, cfg: DecoderConfig) -> int:
    """The longest sequence this side serves: the spec's, capped by the checkpoint's
    positions and by the pool (one sequence must always fit, with the blocks its next
    drafts need, or preemption could never free enough)."""
    par = parallel_of(graph.spec, role)
    wanted = min(graph.spec.model.max_model_len, cfg.max_position_embeddings)
    return min(wanted, graph.budgets[role].pool_blocks * par.block_size - draft_lookahead(graph, role))


def draft_lookahead(graph: RunGraph, role: str) -> int:
    """Positions past a sampled sequence's tokens that its next step's drafts occupy (the
    owner reserves their blocks): k on a side that keeps drafts, else none."""
    if graph.drafter is None or not duties(graph.drafter, role).keep_drafts:
        return 0
    return graph.spec.drafter.num_speculative_tokens


@dataclass(kw_only=True)
class Stage:
    """What one rank holds: its plan, model slice, KV caches (by unit name through
    ``kv``), the runner, and decode graphs when the device and backend allow them."""

    plan: RankPlan
    config: DecoderConfig
    folder: Path | None
    model: CausalLM
    kv: KVCacheBinding
    runner: StageRunner
    graphs: DecodeGraphRunner | None
    # Width of the hidden states this stage receives (None on the first stage: token ids),
    # and how many relayed tap rows come with them.
    hidden_in: int | None = None
    relayed_in: int = 0
    # New tokens a warm-up step takes at most (0: no warm-up), and the batch it covers.
    warm_tokens: int = 0
    max_num_seqs: int = 1
    # The longest prompt part one step can carry (the step budget, the pool, a prompt
    # shorter than the model's length): the warm-up meets each prefill-kernel length break
    # up to it.
    max_step_tokens: int = 0
    # P/D: this rank's end of the KV transfer, once the owner opened it, and its sender
    # (made at the first export; ``report_sent`` is where it reports, None: kept here).
    link: KVLink | None = None
    sender: KVSender | None = None
    report_sent: Callable[[KVSent], None] | None = None
    on_settle: Callable[[], None] | None = None  # in process: told when an export settles
    # Speculative decoding, on the last stage when the graph plans a drafter: the drafter's
    # per-step part and its draft KV pool (units exported like the target's).
    drafting: Drafting | None = None
    draft_kv: KVCacheBinding | None = None
    # Steady drafted steps (verify, context write, propose) as CUDA graphs, when this stage
    # is the whole model and its drafter proposes from device tensors alone.
    drafted_graphs: DraftedGraphRunner | None = None
    # Prefill and mixed steps (and decode steps past the decode graphs) as CUDA graphs cut
    # at the attention calls, when the decode graphs are on and the model is dense.
    piecewise: PiecewiseGraphRunner | None = None

    def replay_drafted(self, step: StepInput) -> DraftedStep | None:
        """A steady drafted step through the drafted graphs (its whole forward, drafting
        included); None when it is not one, and the step runs as usual."""
        runner = self.drafted_graphs
        if runner is None or not runner.applies(step):
            return None
        return runner.run(step)

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, meta,
                taps_in: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """Hidden states and relayed taps out of this stage, and whether a CUDA graph ran."""
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden, taps = self.graphs.run(inputs, positions, meta, taps_in)
            return hidden, taps, True
        if self.piecewise is not None and self.piecewise.can_run(inputs):
            hidden, taps = self.piecewise.run(inputs, positions, meta, taps_in)
            return hidden, taps, False  # graphed in pieces: the attention ran eagerly
        hidden, taps = self.runner.forward(inputs, positions, meta, taps_in)
        return hidden, taps, False

    def warm_up(self, *, announce: str | None = None) -> float:
        """Compile and capture everything this stage's steps can meet (``warm_up``
        module), before the rank answers ready; the seconds it took. Every TP peer of the
        stage calls it at start, together."""
        return warm_up(self, announce=announce)

    def export(self, exports: list[KVExport]) -> None:
        """Hand the step's finished prompts to the sender, right after the forward (and
        the PP send) that wrote them is enqueued; they settle later (``KVSent``)."""
        if self.sender is None:
            self.sender = KVSender(self.link, role=self.plan.role, rank=self.plan.rank,
                                   device=self.runner.device, report=self.report_sent, on_settle=self._settled_one)
        self.sender.start(exports)

    def _settled_one(self) -> None:
        """The sender's call after each report: ``on_settle``'s, whenever that was set."""
        if self.on_settle is not None:
            self.on_settle()

    def settled(self, wait_s: float = 0.0) -> list[KVSent]:
        """In process: the exports settled since the last call (``KVSender.settled``)."""
        return self.sender.settled(wait_s) if self.sender is not None else []

    def close_consumer(self, consumer: str) -> None:
        """Let the exports in flight to consumer instance ``consumer`` settle and stop its
        thread of the sender (before its peers are forgotten or replaced); the other
        consumers' exports go on. Its reports come as usual (in process: ``settled``)."""
        if self.sender is not None:
            self.sender.close_consumer(consumer)

    def close_sender(self) -> None:
        """Let every export in flight settle and stop the sender (at release: nothing takes
        its reports after; re-pairing and forgetting close one consumer's, ``close_consumer``)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def draft(self, step: StepInput, ids: torch.Tensor, positions: torch.Tensor, meta,
              hidden: torch.Tensor, taps: torch.Tensor | None) -> DraftedStep | None:
        """The drafter's part of the step (every TP rank of the last stage); None when this
        stage holds no drafter. Runs before the step's export starts: it writes draft units."""
        if self.drafting is None:
            return None
        return self.drafting.step(step, ids, positions, meta, hidden, taps, self.model.compute_logits)

    def score_prompts(self, step: StepInput, hidden: torch.Tensor) -> list[PromptLogprobs]:
        """Prompt logprobs the step asks for (every TP rank of the last stage calls it)."""
        return score_prompts(step, hidden, self.model.compute_logits)

    def answer(self, step: StepInput, logits: torch.Tensor | None, taps: torch.Tensor | None,
               graphed: bool, drafted: DraftedStep | None = None,
               prompt: list[PromptLogprobs] | None = None) -> StepOutput:
        """The sampling rank's StepOutput: tokens, whether a graph ran, taps and logprobs
        if asked."""
        if drafted is None:
            out = self.runner.output(step, logits)
        else:
            out = StepOutput(step=step.step, token_ids=[t for run in drafted.tokens for t in run],
                             logprobs=[x for run in drafted.logprobs for x in run],
                             num_emitted=[len(run) for run in drafted.tokens], draft_ids=drafted.drafts,
                             top_logprobs=drafted.top)
        out.prompt_logprobs = prompt or []
        out.cuda_graph = graphed
        if step.capture_taps and taps is not None:
            host = taps.float().cpu().contiguous()
            out.taps, out.taps_shape = host.numpy().tobytes(), list(host.shape)
        return out

    def kv_caches(self) -> dict[str, torch.Tensor]:
        """This rank's KV pool, one tensor per unit name (what a KV transfer registers),
        draft units included."""
        caches = self.kv.by_name()
        if self.draft_kv is not None:
            caches.update(self.draft_kv.by_name())
        return caches

    def release(self) -> None:
        """Give the device memory back: graphs, caches and weights."""
        self.close_sender()
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.graphs is not None:
            self.graphs.release()
        if self.drafted_graphs is not None:
            self.drafted_graphs.release()
        if self.piecewise is not None:
            self.piecewise.release()
        device = self.runner.device
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = attn.k_scale = attn.v_scale = None
        self.kv.caches.clear()
        if self.draft_kv is not None:
            self.draft_kv.caches.clear()
        self.graphs = self.model = self.runner = self.drafting = self.draft_kv = self.drafted_graphs = None
        self.piecewise = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()


def build_stage(graph: RunGraph, role: str, rank: int, device: torch.device) -> Stage:
    """Build rank ``rank`` of ``role``'s stage on ``device``. A TP rank must have set its
    TP group (``model.layers.set_tp_group``) first."""
    spec = graph.spec
    plan = graph.instance(role)
    me = plan.ranks[rank]
    stage = plan.stages[me.stage]
    par = parallel_of(spec, role)
    folder, cfg = model_config(spec.model)
    dtype = TORCH_DTYPES[spec.model.dtype]
    model = build_model(
        cfg, folder=folder, dtype=dtype, device=device, layer_range=stage.layers,
        tp_rank=me.tp_rank, tp_size=par.tp, seed=spec.seed,
    )
    kv = KVCacheBinding(list(me.target_units), graph.budgets[role].pool_blocks, device)
    backend = get_backend(par.attention_backend)
    kv.bind(model.attention_layers(), backend)
    drafting, draft_kv, capture = None, None, stage.taps_captured
    if graph.drafter is not None and stage.holds_drafter:
        drafter, draft_kv = build_rank_drafter(graph, role, me, model, cfg, folder, device, dtype, backend)
        drafting = Drafting(drafter, duties(graph.drafter, role), num_drafts=spec.drafter.num_speculative_tokens,
                            seed=spec.seed, device=device)
        if not spec.drafter.taps_declared:  # eagle3: taps its checkpoint names (pp=1 only)
            capture = drafter.tap_layers
    runner = StageRunner(model, device, capture_layers=capture)
    first = me.stage == 0
    hidden_in = None if first else cfg.hidden_size
    relayed_in = 0 if first else len(plan.stages[me.stage - 1].taps_relayed)
    graphs = None
    if not par.enforce_eager and graphs_supported(model, device):
        width = -(-served_max_model_len(graph, role, cfg) // par.block_size)
        rows = decode_graph_rows(par.max_num_seqs, draft_lookahead(graph, role), par.max_num_batched_tokens)
        graphs = DecodeGraphRunner(
            runner, max_batch=rows, block_table_width=width,
            hidden_size=hidden_in, relayed_in=relayed_in, dtype=dtype,
        )
    drafted_graphs = piecewise = None
    if graphs is not None and first and drafting is not None:
        drafted_graphs = drafted_graph_runner(runner, drafting, par, width)
    if graphs is not None and par.piecewise_graphs and piecewise_supported(model):
        piecewise = PiecewiseGraphRunner(runner, max_tokens=par.max_num_batched_tokens, hidden_size=hidden_in,
                                         relayed_in=relayed_in, dtype=dtype)
    pool_tokens = graph.budgets[role].pool_blocks * par.block_size
    warm = min(WARM_UP_TOKENS, par.max_num_batched_tokens, pool_tokens)
    return Stage(plan=me, config=cfg, folder=folder, model=model, kv=kv, runner=runner,
                 graphs=graphs, hidden_in=hidden_in, relayed_in=relayed_in, warm_tokens=warm,
                 max_num_seqs=par.max_num_seqs,
                 max_step_tokens=min(par.max_num_batched_tokens, pool_tokens, served_max_model_len(graph, role, cfg) - 1),
                 drafting=drafting, draft_kv=draft_kv, drafted_graphs=drafted_graphs, piecewise=piecewise)


def drafted_graph_runner(runner: StageRunner, drafting: Drafting, par: ParallelSpec,
                         width: int) -> DraftedGraphRunner | None:
    """Drafted-step graphs for a stage that is the whole model, when its drafter is
    ``graphable`` and keeps its drafts (a consumer); batches up to what one step's token
    budget and MAX_GRAPH_ROWS hold at k+1 rows a sequence."""
    k1 = drafting.num_drafts + 1
    if not (drafting.drafter.graphable and drafting.duties.keep_drafts and k1 <= ROWS_AS_DECODE):
        return None
    fits = min(par.max_num_seqs, par.max_num_batched_tokens // k1, MAX_GRAPH_ROWS // k1)
    return DraftedGraphRunner(runner, drafting, max_batch=fits, block_table_width=width) if fits > 0 else None
