"""The served costs the estimate is priced with, against hand-computed cases: engine steps
timed where they run (a busy turn to the next, never an idle gap), the counters a probe
reads them from, and each rank layout's costs derived so that the model, priced back at
the probe's shape, gives what the probe measured."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from estimate_kit import tiny_profile

from pdflow.bench.estimate import Pricer
from pdflow.bench.profile import MachineProfile, ServedProbe
from pdflow.bench.served_costs import layout_costs, probe_graph
from pdflow.engine.outputs import TokenOutput
from pdflow.engine.sampling_params import SamplingParams
from pdflow.graph import CONSUMER, PRODUCER, build_graph
from pdflow.serve.metrics import ServeMetrics
from pdflow.serve.serving_core import ServingCore, Ticket
from pdflow.serve.step_probe import decode_gap_s, step_totals
from pdflow.spec.load import compose_spec


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TimedBackend:
    """One token per running request a step; each step takes ``durations`` in turn."""

    num_kv_blocks, block_size, num_free_kv_blocks = 64, 16, 64

    def __init__(self, clock: Clock, durations: list[float]):
        self.clock, self.durations, self.running, self.ids = clock, list(durations), {}, 0

    def add(self, prompt_token_ids, sampling, *, route=None):
        self.ids += 1
        self.running[str(self.ids)] = [0, sampling.max_tokens]
        return str(self.ids)

    def wake(self):
        pass

    def step(self):
        if not self.running:
            return []
        self.clock.t += self.durations.pop(0)
        out = []
        for rid, state in list(self.running.items()):
            state[0] += 1
            done = state[0] == state[1]
            out.append(TokenOutput(request_id=rid, index=state[0] - 1, token_id=10, logprob=0.0, text="a",
                                   finished=done, finish_reason="length" if done else None))
            if done:
                del self.running[rid]
        return out

    def draft_stats(self, request_id):
        return None

    def abort(self, request_id):
        return self.running.pop(request_id, None) is not None


def test_a_busy_turn_is_timed_to_the_next_and_an_idle_gap_is_not():
    clock = Clock()
    steps = []
    core = ServingCore(TimedBackend(clock, [5.0, 3.0, 2.0]), clock=clock,
                       on_step=lambda kind, rows, s: steps.append((kind, rows, s)))
    for n in (3, 2):
        core.offer(Ticket(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=n), deliver=lambda e: None))
    core.turn()  # t 0 -> 5: both first tokens
    core.turn()  # 5 -> 8: both continue, the second finishes
    core.turn()  # 8 -> 10: the first finishes; nothing left in the engine
    clock.t += 100.0  # an idle wait before the next turn
    core.turn()
    assert steps == [("prefill", 2, 5.0), ("decode", 2, 3.0)]  # the last step's end is unknown: not counted


def test_step_counters_on_metrics_give_a_streams_mean_time_per_token():
    backend = SimpleNamespace(num_kv_blocks=8, num_free_kv_blocks=8, startup_s=0.0, compile_s=0.0)
    metrics = ServeMetrics(backend)
    metrics.on_step("prefill", 4, 0.5)
    before = step_totals(metrics.render().decode())
    assert before == {("prefill", 4): (1.0, 0.5)}
    for kind, rows, seconds in [("decode", 4, 0.03), ("decode", 4, 0.05), ("empty", 0, 0.01), ("decode", 2, 0.02),
                                ("prefill", 4, 0.4)]:
        metrics.on_step(kind, rows, seconds)
    after = step_totals(metrics.render().decode())
    # decode tokens 4 + 4 + 2 = 10 over 4 streams: 2.5 tokens a stream in 0.03 + 0.05 + 0.01 + 0.02 s
    assert decode_gap_s(before, after, 4) == pytest.approx(0.11 / 2.5)
    assert decode_gap_s(after, after, 4) == 0.0


def _profile(**kw) -> MachineProfile:
    """The kit's profile with the serving costs these cases price (no pre-table overheads)."""
    return tiny_profile(contexts=(32, 512), **({"step_overhead_s": 0.0, "rank_step_overhead_s": 0.0,
                                                "request_overhead_s": 0.02, "request_overhead_per_token_s": 1e-4}
                                               | kw))


def _probe(tp: int, pp: int, step: float, long_ttft: float) -> ServedProbe:
    return ServedProbe(tp=tp, pp=pp, step_s=step, ttft_s=0.0, batch=4, batch_step_s=step, prompt_tokens=4,
                       context=28, long_prompt_tokens=128, batch_long_ttft_s=long_ttft)


def test_a_tp2_layouts_costs_by_hand():
    steps, tokens = layout_costs(_profile(), [_probe(2, 1, 0.06, 0.3)])
    # 4 streams of decode on tp2 (one thread a rank, 2 ranks on 2 cores: no crowding): the
    # step overhead, a rank message, 8 layers + head of the tp2 shard, 16 all-reduces of 4 rows
    priced = 0.01 + 2e-4 + 8 * 3e-3 + 7e-4 + 16 * (5e-4 + 4 * 256 * 4 / 1e9)
    assert steps == {"tp2pp1": pytest.approx(0.06 - priced)}
    # 4 prompts of 128 in one step: 512 tokens, each layer dense once + 4 prompts' attention;
    # each request's own cost (0.02 + 128 x 0.1 ms); what is left over the step's 512 tokens
    step = 0.01 + 2e-4 + steps["tp2pp1"] + 8 * (1.5e-3 + 4 * 1.5e-3) + 7e-4 + 16 * (5e-4 + 512 * 256 * 4 / 1e9)
    assert tokens == {"tp2pp1": pytest.approx((0.3 - (step + 4 * (0.02 + 0.0128))) / 512)}


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (4, 1), (1, 4)])
def test_each_layout_priced_back_gives_what_its_probe_measured(tp, pp):
    probe = _probe(tp, pp, 0.09, 0.6)
    steps, tokens = layout_costs(_profile(), [probe])
    key = f"tp{tp}pp{pp}"
    assert steps[key] > 0 and tokens[key] > 0
    pricer = Pricer(graph=probe_graph(probe), profile=_profile(table_rank_step_by_layout=steps,
                                                               rank_prefill_token_s_by_layout=tokens), role=CONSUMER)
    # decode: the estimate's tokens/s (depth steps in flight) is the probe's 4 streams' rate
    assert 4 * pricer.depth(4) / pricer.step_s(4, 28, 4) == pytest.approx(4 / 0.09)
    _, tok_s = pricer.prefill(128, 4)
    assert 512 / tok_s == pytest.approx(0.6)  # prefill: the time to the last of 4 first tokens


def test_a_probe_faster_than_priced_adds_nothing_and_one_rank_layouts_are_skipped():
    steps, tokens = layout_costs(_profile(), [_probe(2, 1, 0.001, 0.001), _probe(1, 1, 0.02, 0.3)])
    assert steps == {"tp2pp1": 0.0} and tokens == {"tp2pp1": 0.0}


def test_the_layout_cost_prices_a_prefill_step_and_ttft_and_only_its_own_layout():
    prof = _profile(table_rank_step_by_layout={"tp1pp2": 4e-3}, rank_prefill_token_s_by_layout={"tp1pp2": 1e-5})
    pp2 = Pricer(graph=build_graph(compose_spec(["drafter=none", "mode=monolithic", "decode=tp1", "decode.pp=2"])),
                 profile=prof, role=CONSUMER)
    bare = Pricer(graph=pp2.graph, profile=replace(prof, rank_prefill_token_s_by_layout={}), role=CONSUMER)
    alone, tok_s = pp2.prefill(128, 4)
    bare_alone, bare_tok_s = bare.prefill(128, 4)
    assert alone == pytest.approx(bare_alone + 128 * 1e-5)
    assert 512 / tok_s == pytest.approx(512 / bare_tok_s + 512 * 1e-5)
    # the rank step: each of 2 stages' own, as measured for this layout (no crowd rule)
    assert pp2.overhead_s() == pytest.approx(0.01 + 2e-4 + 2 * 4e-3 + 3e-4)
    # a P/D prefill side of the same layout prices the same; another layout falls back
    pd = Pricer(graph=build_graph(compose_spec(["drafter=none", "prefill=pp2", "decode=tp2"])), profile=prof,
                role=PRODUCER)
    assert pd.prefill_token_s() == 1e-5
    tp2 = Pricer(graph=pd.graph, profile=prof, role=CONSUMER)
    assert tp2.prefill_token_s() == 0.0 and tp2.overhead_s() == pytest.approx(0.01 + 2e-4 + 2e-3)


def test_layout_costs_and_probes_survive_save_and_load(tmp_path):
    probe = _probe(1, 4, 0.1, 0.5)
    probe.rounds = {"batch_step_s": [0.1, 0.11, 0.09]}
    prof = _profile(table_rank_step_by_layout={"tp1pp4": 0.01}, rank_prefill_token_s_by_layout={"tp1pp4": 2e-5},
                    probes=[probe])
    assert MachineProfile.load(prof.save(tmp_path / "p.json")) == prof


def test_a_pd_requests_exchange_is_what_pd_first_tokens_took_beyond_the_priced_prefill():
    from pdflow.bench.served_costs import exchange_costs

    probe = ServedProbe(disaggregated=True, step_s=0.0, ttft_s=0.0, batch=4, batch_ttft_s=0.14, prompt_tokens=4,
                        long_prompt_tokens=128, batch_long_ttft_s=0.26, context=28)
    request, per_token = exchange_costs(_profile(), probe)
    # 4 prompts of 4 tokens: a decode-shaped step (16 tokens over 4 rows: 8 layers x 1 ms + head
    # 0.5 ms + the step's 10 ms) and 4 requests' own cost (20 ms + 4 x 0.1 ms)
    short = (0.14 - (0.0185 + 4 * (0.02 + 4e-4))) / 4
    # 4 of 128: 8 layers x (dense 0.5 ms + 4 prompts' attention 0.5 ms) + head + step, 4 x (20 + 12.8 ms)
    long = (0.26 - (0.0305 + 4 * (0.02 + 0.0128))) / 4
    assert per_token == pytest.approx((long - short) / 124)
    assert request == pytest.approx(short - 4 * per_token)  # a request of no prompt: the line's intercept
    prof = _profile(exchange_request_s=request, exchange_token_s=per_token)
    producer = Pricer(graph=probe_graph(probe), profile=prof, role=PRODUCER)
    assert 512 / producer.prefill(128, 4)[1] == pytest.approx(0.26)  # priced back: the probe, both lengths
    assert 16 / producer.prefill(4, 4)[1] == pytest.approx(0.14)
    mono = Pricer(graph=build_graph(compose_spec(["drafter=none", "mode=monolithic", "decode=tp1"])), profile=prof,
                  role=CONSUMER)
    assert 512 / mono.prefill(128, 4)[1] == pytest.approx(0.0305 + 4 * (0.02 + 0.0128))  # no exchange


@pytest.mark.parametrize("measured", [4000.0, 1500.0])
def test_a_layouts_sustained_prefill_rate_prices_back_either_side_of_the_model(measured):
    probe = replace(_probe(1, 2, 0.02, 0.3), prefill_tok_s=measured)
    steps, _ = layout_costs(_profile(), [probe])
    stepped = _profile(table_rank_step_by_layout=steps)
    _, priced = Pricer(graph=probe_graph(probe), profile=stepped, role=CONSUMER).prefill(128, 4)
    _, tokens = layout_costs(_profile(), [probe])
    assert tokens["tp1pp2"] == pytest.approx(1 / measured - 1 / priced)  # per token of a step, either sign
    pricer = Pricer(graph=probe_graph(probe), role=CONSUMER,
                    profile=_profile(table_rank_step_by_layout=steps, rank_prefill_token_s_by_layout=tokens))
    alone, tok_s = pricer.prefill(128, 4)
    assert tok_s == pytest.approx(measured)
    bare_alone, _ = Pricer(graph=probe_graph(probe), profile=stepped, role=CONSUMER).prefill(128, 4)
    # a lone prompt's latency: only a cost adds to it, a pipeline's throughput gain does not
    assert alone == pytest.approx(bare_alone + 128 * max(0.0, tokens["tp1pp2"]))


def test_a_faster_layout_is_never_priced_past_its_busiest_stage():
    prof = _profile(table_rank_step_by_layout={"tp1pp2": 0.0}, rank_prefill_token_s_by_layout={"tp1pp2": -1.0})
    pricer = Pricer(graph=build_graph(compose_spec(["drafter=none", "mode=monolithic", "decode=tp1", "decode.pp=2"])),
                    profile=prof, role=CONSUMER)
    # 512 tokens as 4 prompts of 128, 4 layers of the tp1 / 1-thread shard (dense 1 ms + 4 x attention
    # 1 ms) and the head on the last stage
    assert pricer.prefill(128, 4)[1] == pytest.approx(512 / (4 * (1e-3 + 4 * 1e-3) + 6e-4))


def test_a_pd_requests_exchange_goes_by_the_rank_pairs_that_move_its_kv():
    from pdflow.bench.served_costs import exchange_costs

    prof = _profile(exchange_request_s=0.004, exchange_request_by_pairs={"1": 0.004, "4": 0.016})

    def exchange(*overrides):
        return Pricer(graph=build_graph(compose_spec(["drafter=none", *overrides])), profile=prof,
                      role=PRODUCER).exchange_request_s()

    # 4 ms a request at 1 pair, 16 at 4: 4 ms a pair beyond the first
    assert exchange("prefill=tp1", "decode=tp1") == pytest.approx(0.004)
    assert exchange("prefill=tp2", "decode=tp2") == pytest.approx(0.008)  # 2 pairs: each tp rank its heads
    assert exchange("prefill=pp2", "decode=tp2") == pytest.approx(0.016)  # 2 stages x 2 consumer ranks
    assert exchange("prefill=pp4", "decode=tp4") == pytest.approx(0.004 + 15 * 0.004)  # 16 pairs: extended
    single = _profile(exchange_request_s=0.004, exchange_request_by_pairs={"1": 0.005})
    assert Pricer(graph=build_graph(compose_spec(["drafter=none", "prefill=pp4", "decode=tp4"])), profile=single,
                  role=PRODUCER).exchange_request_s() == 0.005  # one count served: its figure
    # the same probe priced with a per-token cost given: what both lengths leave at no prompt, their mean
    probe = ServedProbe(disaggregated=True, tp=4, step_s=0.0, ttft_s=0.0, batch=4, batch_ttft_s=0.14, prompt_tokens=4,
                        long_prompt_tokens=128, batch_long_ttft_s=0.3, context=28)
    request, per_token = exchange_costs(_profile(), probe, per_token=1e-4)
    short = (0.14 - (0.0185 + 4 * (0.02 + 4e-4))) / 4 - 4e-4
    long = (0.3 - (0.0305 + 4 * (0.02 + 0.0128))) / 4 - 0.0128
    assert per_token == 1e-4 and request == pytest.approx((short + long) / 2)
