"""`pdflow` command line: subcommands dispatch to Hydra apps over the packaged config tree.

``pdflow plan [--json] [hydra overrides...]`` builds and validates the run graph; it needs
no GPU and starts no process. Any refusal makes every command exit non-zero.
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig

from pdflow.graph import GraphRefused, build_graph
from pdflow.spec.load import spec_from_config

CONFIG_PATH = "pkg://pdflow.conf"
USAGE = """usage: pdflow <command> [options] [hydra overrides...]

commands:
  plan [--json]   show and validate the run graph (stages, heads, drafter taps, KV units,
                  head cuts, block budgets, refusals); -m sweeps print one plan per job
  serve           start the OpenAI-compatible API (Ctrl-C stops; serve.port, serve.api_key)
  run             serve, run the workload against the API, log to MLflow; -m sweeps
  compare         a sweep's runs from MLflow as a markdown table and a plot (--help)

examples:
  pdflow plan
  pdflow plan +experiment=ref_pp4_tp4_dspark
  pdflow plan prefill=pp4 decode=tp4 drafter=eagle3     # refused: EAGLE3_UNDER_PP
  pdflow plan -m prefill=pp4,tp4 drafter=dspark,none
  pdflow serve decode=tp1 serve.port=8000
  pdflow run -m prefill=pp2,tp2 drafter=dspark,none workload=arith
  pdflow compare --by prefill,drafter
"""

# Flags Hydra's parser must not see, and what the jobs found (a sweep runs several).
_state: dict[str, int] = {"json": 0, "refused_jobs": 0}


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def _plan(cfg: DictConfig) -> None:
    graph = build_graph(spec_from_config(cfg))
    if _state["json"]:
        print(json.dumps(graph.to_dict(), indent=1))
    else:
        from pdflow.graph.render import render

        render(graph)
    if graph.refusals:
        _state["refused_jobs"] += 1
        print(GraphRefused(graph.refusals), file=sys.stderr)


def _serve() -> None:
    from pdflow.cli_serve import main as serve_main

    serve_main()


def _run() -> None:
    from pdflow.cli_run import main as run_main

    run_main()


def _compare() -> None:
    from pdflow.tracking.compare import main as compare_main

    raise SystemExit(compare_main(sys.argv[1:]))


COMMANDS = {"plan": _plan, "serve": _serve, "run": _run, "compare": _compare}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"pdflow: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    _state["json"] = int("--json" in rest)
    _state["refused_jobs"] = 0
    rest = [a for a in rest if a != "--json"]
    sys.argv = [f"pdflow {command}", *rest]
    COMMANDS[command]()
    if _state["refused_jobs"]:
        raise SystemExit(2)


if __name__ == "__main__":
    main()
