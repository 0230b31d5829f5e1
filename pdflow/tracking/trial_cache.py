"""A sweep's trials that repeat a deployment already run under the same parent.

Optuna samples a categorical space with replacement, and a monolithic trial ignores every
prefill-side and transfer choice, so a search asks for the same deployment again and
again (one CPU search spent 16 of its 24 trials on monolithic variants of a few
deployments, each launched and measured anew). Every ``pdflow run`` is tagged with a key
of what decides its result; in a sweep, a job whose key a finished sibling already has
returns that sibling's objective to the sweeper without launching anything, tagged as
its duplicate (and as pruned, when the sibling was). A duplicate logs no measurements of
its own, so ``pdflow compare`` and the Pareto front count each deployment once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from pdflow.tracking.estimate_log import OBJECTIVE, PRUNED_TAG
from pdflow.tracking.run_logger import PARENT_TAG, TrackedRun

KEY_TAG = "pdflow.deployment_key"
DUPLICATE_TAG = "pdflow.duplicate_of"
# Top-level config keys that do not change what a run measures.
IGNORED = ("name", "tracking", "hydra")
# Nor, in a monolithic run, these groups: it starts no prefill instance and moves no KV
# (values the decode side takes from them by interpolation are resolved before keying).
MONOLITHIC_IGNORED = ("prefill", "transfer")


def deployment_key(tree: dict) -> str:
    """What decides a run's result, hashed: the resolved config without ``IGNORED`` (and,
    monolithic, without ``MONOLITHIC_IGNORED``)."""
    ignored = IGNORED + (MONOLITHIC_IGNORED if tree.get("mode") == "monolithic" else ())
    kept = {k: v for k, v in tree.items() if k not in ignored}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True, slots=True)
class EarlierTrial:
    run_id: str
    objective: float  # its goodput per device; 0 when pruned
    pruned: str | None = None  # why the estimate pruned it, if it did


def earlier_result(tracked: TrackedRun, key: str) -> EarlierTrial | None:
    """The first finished sibling of this sweep child with the same key (measured or
    pruned). None outside a sweep, with tracking off, or when no sibling has run this
    deployment."""
    if not tracked.enabled or not tracked.parent_run_id:
        return None
    found = tracked.search_experiment(
        f"tags.`{PARENT_TAG}` = '{tracked.parent_run_id}' and tags.`{KEY_TAG}` = '{key}' "
        "and attributes.status = 'FINISHED'")
    for run in sorted(found, key=lambda r: r.info.start_time):
        if run.info.run_id == tracked.run_id or DUPLICATE_TAG in run.data.tags:
            continue
        if OBJECTIVE in run.data.metrics:
            return EarlierTrial(run_id=run.info.run_id, objective=run.data.metrics[OBJECTIVE])
        if PRUNED_TAG in run.data.tags:
            return EarlierTrial(run_id=run.info.run_id, objective=0.0, pruned=run.data.tags[PRUNED_TAG])
    return None
