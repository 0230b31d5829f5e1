"""Workload, serving, tracking, and the root spec that one composed Hydra config becomes."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from pdflow.spec.drafter import DrafterSpec
from pdflow.spec.model import ModelSpec
from pdflow.spec.parallel import ParallelSpec
from pdflow.spec.router import RouterSpec
from pdflow.spec.transfer import TransferSpec

WORKLOAD_KINDS = ("none", "arith", "needle", "accuracy", "prefill", "serve", "replay", "multiturn")


def _check_range(name: str, pair: list[int]) -> None:
    if len(pair) != 2 or not 1 <= pair[0] <= pair[1]:
        raise ValueError(f"workload.{name} must be [min, max] with 1 <= min <= max, got {list(pair)}")


ARRIVALS = ("poisson", "uniform")


@dataclass(kw_only=True, slots=True)
class SloSpec:
    """Service-level objectives of ``workload=serve``/``replay``: with ``ttft_s`` or
    ``tpot_s`` set, the run also searches its goodput (pdflow/bench/goodput.py): the
    highest request rate at which at least ``attainment`` of the requests meet both,
    found by a ramp from ``start_rate`` (doubling up to ``max_rate``) then bisection
    until the bracket is within ``rel_tol`` or ``max_probes`` rates were tried."""

    ttft_s: float | None = None
    # Time per output token after the first: (latency - ttft) / (tokens - 1).
    tpot_s: float | None = None
    attainment: float = 0.9
    start_rate: float = 1.0
    max_rate: float = 64.0
    rel_tol: float = 0.1
    max_probes: int = 8
    # How a probe spaces its requests at the rate: Poisson, or evenly (a sharp knee).
    arrivals: str = "poisson"
    # A probe sends at least rate x probe_s requests (the workload's, repeated): a burst of
    # a few requests is absorbed by any server, a sustained rate shows its capacity. null:
    # the workload's requests once at every rate.
    probe_s: float | None = None

    @property
    def enabled(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"workload.slo.{name} must be positive seconds (or null: no objective)")
        if not 0.0 < self.attainment <= 1.0:
            raise ValueError(f"workload.slo.attainment must be a fraction in (0, 1], got {self.attainment}")
        if not 0 < self.start_rate <= self.max_rate:
            raise ValueError("workload.slo needs 0 < start_rate <= max_rate (requests per second)")
        if not 0 < self.rel_tol < 1 or self.max_probes < 1:
            raise ValueError("workload.slo needs 0 < rel_tol < 1 and max_probes >= 1")
        if self.probe_s is not None and self.probe_s <= 0:
            raise ValueError("workload.slo.probe_s must be positive seconds (or null: the requests once a rate)")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"workload.slo.arrivals {self.arrivals!r} is not one of {ARRIVALS}")


@dataclass(kw_only=True, slots=True)
class WorkloadSpec:
    """What ``pdflow run`` drives through the served API (pdflow/bench/workloads).

    ``kind``: ``arith`` (k-shot problems, strict/flexible accuracy), ``needle`` (a fact
    at each of ``depths`` of a ``context_len`` haystack), ``accuracy`` (both), ``prefill``
    (random ``prompt_tokens``-token prompts, one output token), ``serve`` (mixed lengths
    from ``input_len``/``output_len``), ``replay`` (the JSONL ``trace``), ``multiturn``
    (conversations whose later turns repeat ``prefix_reuse`` of their prompt, answers
    included unless ``fold_answers`` is off), ``none``."""

    kind: str = "none"
    # arith: problems; needle: samples per depth; prefill/serve: requests; replay: cap (0 = all).
    num_requests: int = 0
    concurrency: int = 1
    max_tokens: int = 64
    seed: int = 0
    temperature: float = 0.0
    k_shot: int = 5
    # arith: longest prompt + answer; needle: haystack length (both in tokens).
    context_len: int = 2048
    depths: list[float] = field(default_factory=lambda: [0.01, 0.25, 0.5, 0.75, 0.99])
    prompt_tokens: int = 512
    input_len: list[int] = field(default_factory=lambda: [32, 256])
    output_len: list[int] = field(default_factory=lambda: [8, 64])
    # serve: Poisson arrivals per second; 0 sends as fast as concurrency allows.
    request_rate: float = 0.0
    # replay: the JSONL file (checked when the workload is built, before launching).
    trace: str | None = None
    # replay: multiplies the trace's arrival times (0.5 replays twice as fast).
    time_scale: float = 1.0
    request_timeout_s: float = 600.0
    progress: bool = True
    # serve/replay: objectives; when set the run reports goodput (bench/goodput.py).
    slo: SloSpec = field(default_factory=SloSpec)
    # multiturn: conversations the requests are spread over, and the part of each later
    # turn's prompt that repeats the turn before it (0: no reuse).
    conversations: int = 4
    prefix_reuse: float = 0.8
    # multiturn: each later turn carries the answer to the turn before (the model's own
    # tokens, as a chat client sends them), so a conversation's next turn goes out once
    # its answer is back (closed loop); false: every turn built ahead, answers left out.
    fold_answers: bool = True
    # multiturn, closed loop: a user's mean think time in seconds between an answer and the
    # next turn (exponential, seeded per turn); 0: at once. Without it the conversations
    # move in lockstep, each round in the order the last one ended: the order an LRU pool
    # evicts in, so under pool pressure each prefix goes just before its next turn.
    think_time_s: float = 0.0
    # multiturn: a system prompt of this many tokens every conversation's first turn starts
    # with (its first prompt_tokens include it); 0: none.
    system_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload.kind {self.kind!r} is not one of {WORKLOAD_KINDS}")
        if self.num_requests < 0 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("workload needs num_requests >= 0, concurrency >= 1, max_tokens >= 1")
        if self.temperature < 0 or self.k_shot < 0 or self.prompt_tokens < 1:
            raise ValueError("workload needs temperature >= 0, k_shot >= 0, prompt_tokens >= 1")
        if self.context_len < 64:
            raise ValueError(f"workload.context_len must be >= 64 tokens, got {self.context_len}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"workload.depths must be fractions in [0, 1], got {list(self.depths)}")
        if self.conversations < 1 or not 0.0 <= self.prefix_reuse < 1.0:
            raise ValueError("workload.multiturn needs conversations >= 1 and 0 <= prefix_reuse < 1, got "
                             f"{self.conversations} and {self.prefix_reuse}")
        if self.think_time_s < 0:
            raise ValueError(f"workload.think_time_s must be >= 0 seconds, got {self.think_time_s}")
        if not 0 <= self.system_prompt_tokens < self.prompt_tokens:
            raise ValueError(f"workload.system_prompt_tokens must be >= 0 and below prompt_tokens (the first turn "
                             f"holds it), got {self.system_prompt_tokens} for {self.prompt_tokens}")
        _check_range("input_len", self.input_len)
        _check_range("output_len", self.output_len)
        if self.request_rate < 0 or self.time_scale <= 0 or self.request_timeout_s <= 0:
            raise ValueError("workload needs request_rate >= 0, time_scale > 0, request_timeout_s > 0")
        if self.slo.enabled and self.kind not in ("serve", "replay"):
            raise ValueError(f"workload.slo (goodput) applies to workload=serve or replay, not {self.kind!r}; "
                             "unset workload.slo.ttft_s/tpot_s or pick workload=serve")


SERVE_ROLES = ("deployment", "prefill", "decode", "router")


@dataclass(kw_only=True, slots=True)
class ServeSpec:
    """Where ``pdflow serve``/``pdflow run`` expose the OpenAI-compatible API."""

    # Loopback by default: exposing the API to the network is a choice (set an api_key).
    host: str = "127.0.0.1"
    # 0 picks a free port.
    port: int = 8000
    # Bearer key on every route but /health; None reads $PDFLOW_API_KEY (unset: no key).
    api_key: str | None = None
    # Model name in /v1/models and requests; None uses model.name.
    model_name: str | None = None
    # Non-empty: serve a router over these instance URLs instead of an instance.
    backends: list[str] = field(default_factory=list)
    # What this ``pdflow serve`` process is: "deployment" (both P/D instances in this
    # process, or a router with ``backends``), "prefill" or "decode" (one instance of the
    # run graph, its own process group), "router" (pairs ``prefill`` with ``decode`` URLs).
    role: str = "deployment"
    # role=router: the prefill and decode instances' URLs, each taken round robin.
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    ready_timeout_s: float = 300.0
    # Larger request bodies are refused with 413 (instance and router).
    max_body_bytes: int = 8 << 20
    # A generation still unanswered after this long is aborted (503); None: no limit. A
    # router waits twice this for a backend's answer or next chunk (None: 600 s, a stall).
    request_timeout_s: float | None = None
    # Requests waiting for KV blocks, at most; more are refused at once (503, Retry-After).
    max_queued_requests: int = 256
    # A request that waited this long for KV blocks is refused (503, Retry-After).
    queue_timeout_s: float = 30.0
    # API front processes (HTTP, tokenization, detokenization, SSE) sharing the listening
    # socket in front of the one engine-core process (role=deployment).
    api_servers: int = 1
    # torch threads of the engine-core process, and of a role=prefill|decode instance's
    # engine thread (what a CPU instance computes with); 0: the host's cores less one per
    # API front, at least 1. On 2 cores the core's two
    # threads waited on whichever one a front had preempted: decode steps 50% slower
    # served than offline (bench/RESULTS.md, issue 30, CPU).
    core_threads: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"serve.port must be 0 (pick free) or a port number, got {self.port}")
        if not self.host:
            raise ValueError("serve.host must be an address to bind (127.0.0.1 for loopback only)")
        for name in ("backends", "prefill", "decode"):
            bad = [u for u in getattr(self, name) if not u.startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"serve.{name} must be http(s):// URLs, got {bad}")
        if self.role not in SERVE_ROLES:
            raise ValueError(f"serve.role {self.role!r} is not one of {SERVE_ROLES}")
        if self.role == "router" and not (self.prefill and self.decode):
            raise ValueError("serve.role=router needs serve.prefill=[URL,...] and serve.decode=[URL,...] "
                             "(the instances started with serve.role=prefill and serve.role=decode)")
        if self.role != "router" and (self.prefill or self.decode):
            raise ValueError(f"serve.prefill/serve.decode name a router's instances; serve.role is {self.role!r} "
                             "(set serve.role=router)")
        if self.ready_timeout_s <= 0:
            raise ValueError("serve.ready_timeout_s must be positive")
        if self.max_body_bytes < 1 or self.max_queued_requests < 0 or self.queue_timeout_s <= 0:
            raise ValueError("serve needs max_body_bytes >= 1, max_queued_requests >= 0, queue_timeout_s > 0")
        if self.api_servers < 1:
            raise ValueError(f"serve.api_servers must be >= 1 (API front processes), got {self.api_servers}")
        if self.api_servers != 1 and (self.role != "deployment" or self.backends):
            what = "a router" if self.backends or self.role == "router" else f"the {self.role} instance"
            raise ValueError(f"serve.api_servers={self.api_servers} starts API fronts before role=deployment's "
                             f"engine-core process; {what} serves from one process (set serve.api_servers=1)")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("serve.request_timeout_s must be positive (or null: no limit)")
        if self.core_threads < 0:
            raise ValueError(f"serve.core_threads must be >= 0 (0: the cores less the API fronts), "
                             f"got {self.core_threads}")

    def core_threads_on(self, cores: int) -> int:
        """The engine's torch threads (engine-core process, or a P/D instance) on a host of
        ``cores`` cores."""
        return self.core_threads or max(1, cores - self.api_servers)


@dataclass(kw_only=True, slots=True)
class TrackingSpec:
    enabled: bool = True
    # Relative sqlite paths are resolved against the launch directory.
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "pdflow"


MODES = ("pd", "monolithic")


@dataclass(kw_only=True, slots=True)
class RunSpec:
    model: ModelSpec = MISSING
    prefill: ParallelSpec = MISSING
    decode: ParallelSpec = MISSING
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    transfer: TransferSpec = field(default_factory=TransferSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    serve: ServeSpec = field(default_factory=ServeSpec)
    router: RouterSpec = field(default_factory=RouterSpec)
    name: str = "pdflow"
    seed: int = 0
    # "pd": a prefill instance writes each prompt's KV into the decode instance.
    # "monolithic": the decode instance serves alone (prefills itself); no producer starts.
    mode: str = "pd"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")
        self.transfer.resolve_auto(devices={self.prefill.device, self.decode.device},
                                   one_owner=self.serve.role == "deployment")
