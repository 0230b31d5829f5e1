"""What the served tiny model's steps and first tokens took beyond their priced compute:
the serving costs ``pdflow profile`` stores and the estimate adds back.

Two kinds. Measured against the step table by hand (``table_overheads``): the engine's
per-step and per-row host work, a served request's own cost, a TP side's rank step work.
Measured per rank layout by pricing the probe's own deployment with the estimate's
``Pricer`` (``layout_costs``): with ``tp x pp`` rank processes, a stage's step work and a
prefill step's cost per token beyond what the model prices, so that the model, priced
back at the probe's shape, gives what the probe measured (on 2 cores four rank
processes take turns while a prefill's activations move between them; the table times
one shard's layer alone). Either is a property of the machine and the layout, used for
any model served so.
"""

from __future__ import annotations

from dataclasses import replace

from pdflow.bench.estimate import Pricer
from pdflow.bench.profile import MachineProfile, ServedProbe, layout_key
from pdflow.bench.step_table import StepTable, interpolate
from pdflow.graph import CONSUMER, PRODUCER, build_graph
from pdflow.spec.load import compose_spec


def table_overheads(table: StepTable, cores: int, layers: int, one: ServedProbe, two: ServedProbe | None,
                    allreduce: float, rank_message: float):
    """(step, row, TP2 rank step, request, request per prompt token) overheads (a layout
    served with rank processes has its own step work, ``layout_costs``): what the served tiny model's steps and first token took beyond
    their table-priced compute (and, with rank processes, collectives), >= 0."""
    def compute(tp: int, tokens: int, rows: int, context: int) -> float:
        """As the estimate prices it: ranks beyond the cores take turns (``Pricer._stage_s``)."""
        threads = max(1, cores // tp)
        shard = table.shard(tp, threads)
        if shard is None:
            return 0.0
        crowd = max(1.0, tp * threads / cores)
        return crowd * (layers * shard.layer_s(tokens, rows, context) + interpolate(shard.head_s, rows))

    step = max(0.0, one.step_s - compute(1, 1, 1, one.context))
    row = 0.0
    if one.batch > 1 and one.batch_step_s > 0:
        row = max(0.0, (one.batch_step_s - step - compute(1, one.batch, one.batch, one.context)) / (one.batch - 1))
    request = max(0.0, one.ttft_s - step - compute(1, one.prompt_tokens, 1, one.prompt_tokens // 2 + 1))

    def share(ttft: float, prompt: int) -> float:
        """A request's share of a batch of them beyond their priced step."""
        tokens = one.batch * prompt
        return (ttft - step - (one.batch - 1) * row - compute(1, tokens, one.batch, prompt // 2 + 1)) / one.batch

    per_token = 0.0
    if one.batch > 1 and one.batch_ttft_s > 0:  # a request's share of a batch of them (a lone one
        # swung 10-40 ms run to run on 2 cores where 4 at once cost ~43 ms each)
        request = max(0.0, share(one.batch_ttft_s, one.prompt_tokens))
        if one.long_prompt_tokens > one.prompt_tokens and one.batch_long_ttft_s > 0:
            per_token = max(0.0, (share(one.batch_long_ttft_s, one.long_prompt_tokens) - request)
                            / (one.long_prompt_tokens - one.prompt_tokens))

    def rank_step(probe: ServedProbe | None, tp: int) -> float:
        """Rank processes: rows' host work overlaps their compute (4 streams cost no more
        than 1 as measured), so both steps measure it: their mean."""
        if probe is None:
            return 0.0
        served = (probe.step_s + probe.batch_step_s) / 2 if probe.batch_step_s > 0 else probe.step_s
        return max(0.0, served - step - rank_message - 2 * layers * allreduce - compute(tp, 1, 1, probe.context))

    return step, row, rank_step(two, 2), request, per_token


PROBE_GPU_MEMORY = 0.25


def probe_overrides(device: str, tp: int = 1, pp: int = 1, disaggregated: bool = False) -> list[str]:
    """The deployment a probe serves (``pdflow.serve.step_probe``): monolithic ``tp`` x
    ``pp``, or P/D tp1 -> ``tp``."""
    layout = ["prefill=tp1", f"decode=tp{tp}"] if disaggregated else ["mode=monolithic", f"decode=tp{tp}",
                                                                       f"decode.pp={pp}"]
    # On a GPU a quarter of it each side: the tiny model's pool needs little, and the
    # default 0.9 leaves a probe no room beside a profile that still holds its buffers.
    memory = [f"decode.memory={PROBE_GPU_MEMORY}", f"prefill.memory={PROBE_GPU_MEMORY}"] if device.startswith("cuda") else []
    return ["model=tiny", *layout, "drafter=none", "tracking=off", f"decode.device={device}",
            f"prefill.device={device}", *memory]


def probe_graph(probe: ServedProbe, device: str = "cpu"):
    """The run graph the probe served."""
    return build_graph(compose_spec(probe_overrides(device, probe.tp, probe.pp, probe.disaggregated)))


def exchange_costs(profile: MachineProfile, probe: ServedProbe, *, per_token: float | None = None
                   ) -> tuple[float, float]:
    """(per request, per prompt token) a P/D request costs beyond what its prefill side
    prices (its serving cost measured monolithic): ``batch`` prompts at once, short and
    long, to the last first token, less the priced prefill step of them, a request's
    share; >= 0. The prefill side has one rank, so nothing else of the layout is in it.
    ``per_token`` given: the request's part from both lengths with that per-token cost."""
    pricer = Pricer(graph=probe_graph(probe, profile.device), role=PRODUCER,
                    profile=replace(profile, exchange_request_s=0.0, exchange_token_s=0.0,
                                    exchange_request_by_pairs={}))

    def share(ttft: float, prompt: int) -> float:
        _, tok_s = pricer.prefill(prompt, probe.batch)
        return (ttft - probe.batch * prompt / tok_s) / probe.batch

    if probe.batch_ttft_s <= 0:
        return 0.0, 0.0
    short = share(probe.batch_ttft_s, probe.prompt_tokens)
    if per_token is not None:  # the mean of what each length leaves at no prompt
        at_zero = [short - probe.prompt_tokens * per_token]
        if probe.batch_long_ttft_s > 0:
            at_zero.append(share(probe.batch_long_ttft_s, probe.long_prompt_tokens) - probe.long_prompt_tokens * per_token)
        return max(0.0, sum(at_zero) / len(at_zero)), per_token
    per_token = 0.0
    if probe.long_prompt_tokens > probe.prompt_tokens and probe.batch_long_ttft_s > 0:
        per_token = (share(probe.batch_long_ttft_s, probe.long_prompt_tokens) - short) / (
            probe.long_prompt_tokens - probe.prompt_tokens)
    per_token = max(0.0, per_token)
    return max(0.0, short - probe.prompt_tokens * per_token), per_token  # at no prompt, and a token's


def layout_costs(profile: MachineProfile, probes: list[ServedProbe]) -> tuple[dict[str, float], dict[str, float]]:
    """(rank step work a stage (>= 0), prefill cost per token) by layout, for each probe
    with rank processes, on a ``profile`` whose other serving costs are already set:

    - decode: the estimate's ``batch`` streams make ``batch * depth / step`` tokens/s,
      the probe a token per stream every ``batch_step_s``; the rank work is what makes
      the two equal, spread over the stages (each stage's ranks do their own);
    - prefill: the layout sustained ``prefill_tok_s`` with ``batch`` prompts of
      ``long_prompt_tokens`` at a time, the estimate prices a rate (``Pricer.prefill``);
      the difference per token of a step, either way (a pipeline of stages, its steps in
      flight, can serve prompts faster than the model's step prices; older probes: one
      batch's time to the last first token, what it took beyond the priced step, >= 0)."""
    steps: dict[str, float] = {}
    tokens: dict[str, float] = {}
    for probe in probes:
        if probe.tp * probe.pp == 1 or probe.batch_step_s <= 0:
            continue
        key, graph = layout_key(probe.tp, probe.pp), probe_graph(probe, profile.device)
        bare = replace(profile, table_rank_step_by_layout=profile.table_rank_step_by_layout | {key: 0.0},
                       rank_prefill_token_s_by_layout=profile.rank_prefill_token_s_by_layout | {key: 0.0})
        pricer = Pricer(graph=graph, profile=bare, role=CONSUMER)
        b = probe.batch
        served = pricer.depth(b) * probe.batch_step_s
        steps[key] = max(0.0, (served - pricer.step_s(b, probe.context, b)) / probe.pp)
        stepped = replace(bare, table_rank_step_by_layout=bare.table_rank_step_by_layout | {key: steps[key]})
        _, tok_s = Pricer(graph=graph, profile=stepped, role=CONSUMER).prefill(probe.long_prompt_tokens, b)
        if probe.prefill_tok_s > 0:  # what the layout sustains: either way of the priced rate
            tokens[key] = 1.0 / probe.prefill_tok_s - 1.0 / tok_s
        elif probe.batch_long_ttft_s > 0 and probe.long_prompt_tokens > 0:  # one batch's latency (older probes)
            n = b * probe.long_prompt_tokens
            tokens[key] = max(0.0, (probe.batch_long_ttft_s - n / tok_s) / n)
    return steps, tokens
