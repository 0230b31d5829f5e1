"""`pdflow` command line: a table of subcommands, each a Hydra app over the packaged
config tree (``COMMANDS``; a new one adds an entry).

Exit codes, for every command: 0 done, 1 a config error (one line on stderr naming the key
and what is allowed; no traceback), 2 the run graph is refused (each refusal with its
code and fix).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pdflow import __version__
from pdflow.graph import GraphRefused, build_graph
from pdflow.spec import RunSpec
from pdflow.spec.errors import SCHEMA_SUFFIX, ConfigError, describe, unknown_choice
from pdflow.spec.load import default_choices, group_choices, spec_from_config

CONFIG_PATH = "pkg://pdflow.conf"
EXIT_OK, EXIT_CONFIG, EXIT_REFUSED = 0, 1, 2
# Flags Hydra's own parser takes (pdflow passes them through); anything else starting
# with "-" is a mistake, reported as a config error rather than argparse's exit 2.
HYDRA_FLAGS = {"-m", "--multirun", "-c", "--cfg", "-p", "--package", "--resolve", "--info",
               "-i", "--hydra-help", "-cp", "--config-path", "-cn", "--config-name", "-cd",
               "--config-dir", "--run", "-r", "-sc", "--shell-completion", "--experimental-rerun"}


@dataclass(kw_only=True, slots=True)
class Command:
    """A subcommand: ``run`` takes the arguments after its name and returns an exit code."""

    summary: str
    run: Callable[[list[str]], int]


def _groups_help() -> str:
    defaults = default_choices()
    lines = []
    for group, options in group_choices().items():
        marked = [f"{o}*" if defaults.get(group) == o else o for o in options]
        lines.append(f"  {group + ':':12}{', '.join(marked)}")
    return "\n".join(lines)


def plan_help() -> str:
    return f"""usage: pdflow plan [--json] [--png FILE] [-m] [override ...]

Build and check the run graph of a deployment without starting anything (no GPU, no
process): stages and ranks with their layers and heads, drafter taps and relays, KV units,
head cuts between prefill and decode, block budgets, and every refusal with its fix.

options:
  --json          print the graph as JSON instead of tables
  --png FILE      also draw it to FILE: stages, ranks, KV heads, the cuts between them
                  (a sweep writes FILE-<job>.png per job)
  --estimate      also price it with the machine profile (pdflow profile): prefill tok/s
                  and TTFT per prompt length, decode step and tok/s per batch, transfer
                  per request, pools, goodput under workload.slo (--profile FILE: another)
  -m, --multirun  sweep: an override with a comma list (prefill=pp4,tp4) runs one plan per
                  combination; Hydra keeps a multirun/<date>/<time>/ folder in the current
                  directory (a single plan writes nothing)
  --cfg job       print the composed config instead of the plan (Hydra; --hydra-help: all)
  -h, --help      this help

overrides (Hydra syntax):
  group=option          choose a config group's option      prefill=pp2 drafter=none
  key=value             set one setting                     decode.block_size=64
  +experiment=name      apply a preset deployment           +experiment=ref_pp4_tp4_dspark
  key=a,b with -m       sweep the values                    -m decode=tp2,tp4

config groups (* = default):
{_groups_help()}

exit codes:
  0  the plan is allowed (every job of a sweep)
  1  a config error: one line on stderr naming the key (decode.block_size) and what is allowed
  2  the run graph is refused (a sweep names each refused job by its overrides)
"""


@dataclass(kw_only=True, slots=True)
class JobsOutcome:
    """What a command's Hydra jobs found (a -m sweep runs several in this process): config
    errors are recorded, not raised, so one bad job neither hides the others nor gets
    Hydra's traceback."""

    config_errors: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    sweep: bool = False

    def exit_code(self, name: str) -> int:
        for line in self.config_errors:
            print(f"pdflow {name}: {line}", file=sys.stderr)
        if self.config_errors:
            return EXIT_CONFIG
        if self.refused and self.sweep:
            print(f"pdflow {name}: {len(self.refused)} job(s) refused: {'; '.join(self.refused)}",
                  file=sys.stderr)
        return EXIT_REFUSED if self.refused else EXIT_OK


def job_name() -> str:
    """This job's overrides, and its number in a sweep: how a user finds it again."""
    hc = HydraConfig.get()
    overrides = " ".join(hc.overrides.task) or "(defaults)"
    return f"job #{hc.job.num} ({overrides})" if hc.mode == RunMode.MULTIRUN else overrides


def job_spec(cfg: DictConfig, outcome: JobsOutcome) -> RunSpec | None:
    """The job's RunSpec, or None once its config error is recorded (named by the job in
    a sweep). An internal ``*_schema`` entry is not a choice, though Hydra lists it."""
    hc = HydraConfig.get()
    outcome.sweep = hc.mode == RunMode.MULTIRUN
    choices = group_choices()
    try:
        for group, choice in hc.runtime.choices.items():
            if group in choices and choice and str(choice).endswith(SCHEMA_SUFFIX):
                raise ConfigError(unknown_choice(group, choice, choices[group]))
        return spec_from_config(cfg)
    except ConfigError as err:
        outcome.config_errors.append(f"{job_name()}: {err}" if outcome.sweep else str(err))
        return None


@dataclass(kw_only=True, slots=True)
class _PlanState:
    json: bool = False
    png: str | None = None
    # --estimate: the profile file to price the graph with (None: no estimate).
    estimate: str | None = None
    outcome: JobsOutcome = field(default_factory=JobsOutcome)


_plan_state = _PlanState()


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def _plan(cfg: DictConfig) -> None:
    outcome = _plan_state.outcome
    spec = job_spec(cfg, outcome)
    if spec is None:
        return
    graph = build_graph(spec)
    if _plan_state.json:
        print(json.dumps(graph.to_dict(), indent=1))
    else:
        from pdflow.graph.render import render

        render(graph)
    if _plan_state.png is not None:
        from pdflow.graph.picture import write_png

        path = Path(_plan_state.png)
        if outcome.sweep:
            path = path.with_name(f"{path.stem}-{HydraConfig.get().job.num}{path.suffix}")
        write_png(graph, path)
    if _plan_state.estimate is not None and not graph.refusals:
        from pdflow.bench.estimate import estimate_run
        from pdflow.bench.estimate import render as render_estimate
        from pdflow.bench.profile import MachineProfile

        est = estimate_run(graph, MachineProfile.load(Path(_plan_state.estimate)))
        print(json.dumps({"estimate": est.to_dict()}, indent=1) if _plan_state.json else render_estimate(est))
    if graph.refusals:
        name = job_name()
        outcome.refused.append(name)
        print(f"pdflow plan: {name}: {GraphRefused(graph.refusals)}", file=sys.stderr)


def run_hydra_app(app: Callable[[], None], name: str, args: list[str]) -> int:
    """Run a ``@hydra.main`` app on ``args``; a config error (composition, override, spec
    check) prints one line and returns EXIT_CONFIG, anything else keeps its traceback."""
    bad = next((a for a in args if a.startswith("-") and a not in HYDRA_FLAGS), None)
    if bad is not None:
        print(f"pdflow {name}: unknown option {bad} (pdflow {name} --help lists them)", file=sys.stderr)
        return EXIT_CONFIG
    saved_argv, saved_full_error = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    sys.argv = [f"pdflow {name}", *args]
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing a traceback
    try:
        app()
    except Exception as err:
        line = describe(err)
        if line is None:
            raise
        print(f"pdflow {name}: {line}", file=sys.stderr)
        return EXIT_CONFIG
    finally:
        sys.argv = saved_argv
        if saved_full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_full_error
    return EXIT_OK


def _estimate_profile(args: list[str]) -> tuple[str | None, list[str]]:
    """``--estimate`` [``--profile FILE``] out of ``args``: the profile's path, None when
    not asked, "" (after saying why) when the profile is missing."""
    from pdflow.bench.profile import default_path

    if "--estimate" not in args:
        return None, args
    args = [a for a in args if a != "--estimate"]
    path = default_path()
    if "--profile" in args:
        at = args.index("--profile")
        if at + 1 >= len(args):
            print("pdflow plan: --profile needs a file (pdflow plan --estimate --profile FILE)", file=sys.stderr)
            return "", args
        path, args = Path(args[at + 1]), args[:at] + args[at + 2:]
    if not path.is_file():
        print(f"pdflow plan: no machine profile at {path} (run pdflow profile first, or pass --profile FILE)",
              file=sys.stderr)
        return "", args
    return str(path), args


def plan_command(args: list[str]) -> int:
    if "-h" in args or "--help" in args:
        print(plan_help())
        return EXIT_OK
    png = None
    if "--png" in args:
        at = args.index("--png")
        if at + 1 >= len(args) or args[at + 1].startswith("-") or "=" in args[at + 1]:
            print("pdflow plan: --png needs a file name (pdflow plan --png plan.png ...)", file=sys.stderr)
            return EXIT_CONFIG
        png, args = args[at + 1], args[:at] + args[at + 2:]
    estimate, args = _estimate_profile(args)
    if estimate == "":
        return EXIT_CONFIG
    _plan_state.json, _plan_state.png, _plan_state.outcome = "--json" in args, png, JobsOutcome()
    _plan_state.estimate = estimate
    code = run_hydra_app(_plan, "plan", [a for a in args if a != "--json"])
    return code or _plan_state.outcome.exit_code("plan")


def take_api_key(args: list[str]) -> list[str]:
    """``--api-key KEY`` (or ``--api-key=KEY``) out of ``args`` into ``$PDFLOW_API_KEY``,
    which the server reads like ``serve.api_key``: a key is never parsed as a Hydra
    override (no quoting, no interpolation of its characters)."""
    out, rest = [], iter(args)
    for arg in rest:
        if arg == "--api-key" or arg.startswith("--api-key="):
            key = arg.partition("=")[2] if "=" in arg else next(rest, "")
            if not key:
                raise ValueError("--api-key needs a key: --api-key KEY (or set $PDFLOW_API_KEY)")
            os.environ["PDFLOW_API_KEY"] = key
        else:
            out.append(arg)
    return out


VERBOSE_ENV = "PDFLOW_VERBOSE"  # read by pdflow/transfer/native_log.py (in every rank)
VERBOSE_FLAGS = {"-v": VERBOSE_ENV, "--verbose": VERBOSE_ENV}


def take_flags(args: list[str], flags: dict[str, str]) -> list[str]:
    """Each of ``flags`` present in ``args`` sets its environment variable to 1 (so rank
    processes and sweep jobs, which inherit the environment, see it) and leaves ``args``."""
    for flag, env in flags.items():
        if flag in args:
            os.environ[env] = "1"
    return [a for a in args if a not in flags]


def hydra_command(module: str, name: str, flags: dict[str, str] | None = None) -> Callable[[list[str]], int]:
    """A command whose ``module.main()`` is a Hydra app over the overrides in sys.argv;
    ``flags`` are its own options (beyond ``-v``), each an environment variable it sets."""

    def run(args: list[str]) -> int:
        import importlib

        if "-h" in args or "--help" in args:
            print(importlib.import_module(module).__doc__)
            return EXIT_OK
        args = take_flags(args, VERBOSE_FLAGS | (flags or {}))
        try:
            args = take_api_key(args)
        except ValueError as err:
            print(f"pdflow {name}: {err}", file=sys.stderr)
            return EXIT_CONFIG
        try:
            return run_hydra_app(importlib.import_module(module).main, name, args)
        except GraphRefused as refused:
            print(f"pdflow {name}: {refused}", file=sys.stderr)
            return EXIT_REFUSED

    return run


def profile_command(args: list[str]) -> int:
    from pdflow.bench.profile import main as profile_main
    from pdflow.serve.step_probe import served_probe

    return profile_main(args, step_probe=served_probe)


def compare_command(args: list[str]) -> int:
    from pdflow.tracking.compare import main as compare_main

    return compare_main(args)


COMMANDS: dict[str, Command] = {
    "plan": Command(
        summary="show and check the run graph (stages, heads, drafter taps, KV units, head "
        "cuts, block budgets, refusals); --json, -m sweeps",
        run=plan_command,
    ),
    "run": Command(
        summary="launch the deployment, run the workload against its API, print the results, "
        "log them to MLflow; -m sweeps (one child run per job)",
        run=hydra_command("pdflow.cli_run", "run", {"--all": "PDFLOW_ALL_METRICS"}),
    ),
    "serve": Command(
        summary="launch the deployment behind an OpenAI-compatible API until Ctrl-C",
        run=hydra_command("pdflow.cli_serve", "serve"),
    ),
    "profile": Command(
        summary="measure this machine (GEMM, memory, host copy, transfer, per-step overhead) "
        "for pdflow plan --estimate (--help)",
        run=profile_command,
    ),
    "compare": Command(
        summary="a sweep's MLflow runs as a markdown table and a plot (--help)",
        run=compare_command,
    ),
}


def usage() -> str:
    commands = "\n".join(f"  {name:8}{c.summary}" for name, c in COMMANDS.items())
    return f"""usage: pdflow <command> [options] [hydra overrides...]
       pdflow --version

commands:
{commands}

`pdflow <command> --help` explains a command, its overrides and the config groups.
exit codes: 0 done, 1 config error (one line naming the key), 2 the run graph is refused.

examples:
  pdflow plan
  pdflow plan +experiment=ref_pp4_tp4_dspark
  pdflow plan prefill=pp4 decode=tp4 drafter=eagle3     # refused: EAGLE3_UNDER_PP
  pdflow plan -m prefill=pp4,tp4 drafter=dspark,none
"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    if argv[0] in ("-V", "--version"):
        print(f"pdflow {__version__}")
        return
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"pdflow: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
    code = command.run(argv[1:])
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
