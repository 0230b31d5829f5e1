"""Whether a side runs overlap scheduling (the host builds step N+1 while the device runs
step N), and the refusal when a config asks for it where it cannot run.

It needs the whole step on this process (one rank: the next step's input tokens are
gathered from the last step's samples on the same device) and one sampled token per
sequence a step (a drafter's verify emits a variable number, so the next step's rows
are not known before the last one is back).
"""

from __future__ import annotations

from pdflow.graph.placement import CONSUMER, PRODUCER, parallel_of
from pdflow.graph.refusals import Code, Refusal
from pdflow.spec import RunSpec


def _blockers(spec: RunSpec, role: str) -> list[str]:
    par = parallel_of(spec, role)
    why = []
    if par.world_size > 1:
        why.append(f"tp={par.tp} x pp={par.pp} runs one process per rank")
    if spec.drafter.enabled:
        why.append(f"the {spec.drafter.kind} drafter emits a variable number of tokens a step")
    return why


def overlap_scheduling(spec: RunSpec, role: str) -> bool:
    """The side's setting resolved: ``None`` (auto) is on for a one-rank CUDA side without a
    drafter; True is honoured where it can run (the graph refuses it elsewhere)."""
    wanted = parallel_of(spec, role).overlap_scheduling
    if wanted is None:
        return parallel_of(spec, role).device == "cuda" and not _blockers(spec, role)
    return wanted and not _blockers(spec, role)


def check_overlap(spec: RunSpec) -> list[Refusal]:
    out = []
    for role, side in ((PRODUCER, "prefill"), (CONSUMER, "decode")):
        if role == PRODUCER and spec.mode == "monolithic":
            continue  # no prefill instance starts
        why = _blockers(spec, role)
        if parallel_of(spec, role).overlap_scheduling and why:
            out.append(Refusal(
                code=Code.OVERLAP_UNSUPPORTED,
                message=f"{side}.overlap_scheduling=true, but {' and '.join(why)}; overlap "
                "scheduling runs only on a one-rank side without a drafter.",
                fix=f"set {side}.overlap_scheduling=null (auto: on where it can run) or false.",
            ))
    return out
