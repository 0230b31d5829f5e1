"""The conditional part of a deployment search, for Hydra's Optuna sweeper
(``hydra.sweeper.custom_search_space``): the sweeper samples its ``params`` for every
trial, then this samples the choices that only some deployments use. Why: a monolithic
trial starts no prefill instance and moves no KV, and a TP prefill has no layer
partition; sampled anyway, those choices make one deployment look like several (trials
spent on repeats) and feed the sampler values that had no effect."""

from __future__ import annotations

from typing import Any

# Sampled for P/D trials only (tracking/trial_cache.MONOLITHIC_IGNORED: the same groups).
PD_ONLY: dict[str, list[str]] = {
    "prefill": ["tp1", "tp2", "tp4", "pp2", "pp4"],
    "transfer": ["auto", "nccl"],
}
# Sampled only when the prefill sampled above is pipeline-parallel.
PP_ONLY: dict[str, list[str]] = {"prefill.partition": ["even", "lighter_last"]}


def pd_choices(cfg: Any, trial: Any) -> None:
    """Add ``PD_ONLY`` (and, for a PP prefill, ``PP_ONLY``) to a P/D trial. A choice fixed
    on the command line (``prefill=pp2``: the sweeper's fixed parameters, a trial's user
    attributes) is not sampled, and counts as the trial's. The mode is the trial's, else a
    fixed one, else the config's."""
    fixed = trial.user_attrs

    def choose(choices: dict[str, list[str]]) -> None:
        for name, values in choices.items():
            if name not in fixed:
                trial.suggest_categorical(name, values)

    if trial.params.get("mode", fixed.get("mode", cfg.get("mode"))) != "pd":
        return
    choose(PD_ONLY)
    prefill = fixed.get("prefill", trial.params.get("prefill", ""))
    if str(prefill).startswith("pp"):
        choose(PP_ONLY)
