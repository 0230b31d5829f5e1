"""``pdflow run [--all] [-v] [hydra overrides...]``: plan, serve, drive the workload over
HTTP, report: one row per workload (requests, errors, accuracy, TTFT, ITL, output tok/s,
draft acceptance, tokens per forward), run-level figures under it. ``--all`` prints every
metric instead (MLflow logs every metric either way); ``-v`` lets the transfer engine's
own log lines through.

Each job is one MLflow run (a child of the sweep's parent under ``-m``), opened before
anything can fail so that a refused plan or a crashed server is a FAILED run with its
error, not a missing one. The served side is the spec's decode instance for now.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf

from pdflow.graph import GraphRefused, build_graph
from pdflow.graph.host import HostFacts, host_refusals, read_devices
from pdflow.spec import TrackingSpec
from pdflow.spec.load import spec_from_config
from pdflow.tracking.callback import JOB_NAME, close_open_sweeps
from pdflow.tracking.estimate_log import OBJECTIVE, PRUNED_TAG
from pdflow.tracking.params import redact
from pdflow.tracking.run_logger import TrackedRun
from pdflow.tracking.tags import hardware_tags
from pdflow.tracking.trial_cache import DUPLICATE_TAG, KEY_TAG, deployment_key, earlier_result

if TYPE_CHECKING:
    from pdflow.bench.workloads.base import WorkloadResult

CONFIG_PATH = "pkg://pdflow.conf"
SERVER_GAUGES = ("pdflow_kv_blocks_total", "pdflow_draft_acceptance_rate", "pdflow_compile_seconds")
# Gauges logged under a run metric's name of their own.
GAUGE_NAMES = {"compile_seconds": "compile_s"}
# Set by ``pdflow run --all`` (an environment variable, so sweep jobs in launcher processes see it).
ALL_METRICS_ENV = "PDFLOW_ALL_METRICS"


def _run_name(cfg: DictConfig) -> str:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        hc = HydraConfig.get()
        if hc.mode is not None and hc.mode.name == "MULTIRUN" and hc.job.override_dirname:
            return hc.job.override_dirname
    return str(cfg.get("name", "pdflow"))


def _tracking_of(tree: dict) -> TrackingSpec:
    return TrackingSpec(**tree.get("tracking", {}))


def server_gauges(url: str, api_key: str | None) -> dict[str, float]:
    """Numbers only the server knows (its KV pool size), read from its /metrics."""
    import math

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10.0).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SERVER_GAUGES and not math.isnan(sample.value):
                name = sample.name.removeprefix("pdflow_")
                out[GAUGE_NAMES.get(name, name)] = sample.value
    return out


def print_results(name: str, result: WorkloadResult, metrics: dict[str, float]) -> None:
    """One row per workload and the run-level figures under it; every metric with
    ``--all`` (``$PDFLOW_ALL_METRICS``)."""
    from pdflow.tracking.results_table import all_metrics_table, console, run_line, workload_table

    out = console()
    if os.environ.get(ALL_METRICS_ENV) == "1":
        out.print(all_metrics_table(name, metrics))
        return
    out.print(workload_table(name, result.per_workload))
    run_figures = {k: v for k, v in metrics.items() if k not in result.metrics}
    if run_figures:
        out.print(run_line(run_figures))


def run_job(cfg: DictConfig) -> dict[str, float]:
    """The run's metrics; a run the estimate pruned (SLOs out of reach) launches nothing
    and returns ``{goodput_per_device: 0}``."""
    from pdflow.bench.workloads import Target, build_workloads, prepare, run_workloads_sync
    from pdflow.serve.launch import serve_spec
    from pdflow.tracking.plots import results_figure
    from pdflow.tracking.store import launch_dir

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    tree = OmegaConf.to_container(cfg, resolve=True)
    key = deployment_key(tree)
    tags = {"pdflow.command": "run", "pdflow.workload": str(tree.get("workload", {}).get("kind")), KEY_TAG: key}
    with TrackedRun(_tracking_of(tree), run_name=_run_name(cfg), tags=tags) as tracked:
        tracked.log_config(tree, OmegaConf.to_yaml(OmegaConf.create(redact(tree))))
        earlier = earlier_result(tracked, key)
        if earlier is not None:  # a sweep asked for a deployment it has already run
            tracked.set_tags({DUPLICATE_TAG: earlier.run_id} | ({PRUNED_TAG: earlier.pruned} if earlier.pruned else {}))
            print(f"pdflow run: this sweep already ran this deployment (run {earlier.run_id}, objective "
                  f"{earlier.objective:.4g}): nothing launched", file=sys.stderr)
            return {OBJECTIVE: earlier.objective}
        spec = spec_from_config(cfg)
        graph = build_graph(spec, read_devices(spec))  # GPU pools sized from the devices here
        tracked.log_json("plan.json", graph.to_dict())
        from pdflow.graph.picture import plan_figure

        tracked.log_figure("plan.png", plan_figure(graph))
        refusals = list(graph.refusals) or host_refusals(graph, HostFacts.probe(spec))
        if refusals:
            tracked.set_tag("pdflow.refusals", ",".join(sorted({r.code.name for r in refusals})))
            raise GraphRefused(refusals)
        from pdflow.tracking.estimate_log import measured_extras, plan_run

        planned = plan_run(tracked, graph)
        if planned.pruned is not None:
            print(f"pdflow run: pruned before launch: {planned.pruned}", file=sys.stderr)
            return {OBJECTIVE: 0.0}
        workloads = build_workloads(spec.workload, vocab=spec.model.vocab, base_dir=launch_dir(),
                                    block_tokens=spec.decode.block_size,
                                    kv_bytes_per_block=graph.transfer_bytes_per_block)
        prepared = prepare(workloads)  # a bad trace fails here, before anything launches
        began = time.monotonic()
        with serve_spec(spec, port=0) as served:  # healthy: every rank built and warmed up
            startup_s = time.monotonic() - began
            target = Target(url=served.url, model=served.model_name, api_key=served.api_key)
            result = run_workloads_sync(target, prepared, spec.workload)
            metrics = result.metrics | server_gauges(served.url, served.api_key) | {"startup_s": startup_s}
        metrics |= measured_extras(planned, metrics)
        tracked.set_tags(hardware_tags())  # now with the devices the run has loaded
        print_results(spec.name, result, planned.metrics | metrics)  # --all: every metric the run logs
        tracked.log_metrics(metrics)
        tracked.log_json("results.json", result.rows)
        from pdflow.tracking.compare import markdown

        tracked.log_text("results.md", markdown(["metric", "value"], [[k, f"{v:.6g}"] for k, v in
                                                                      sorted(metrics.items())]))
        if result.rows:
            import matplotlib.pyplot as plt

            figure = results_figure(result.rows, result.breakdowns)
            tracked.log_figure("results.png", figure)
            plt.close(figure)
        return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def _run(cfg: DictConfig) -> float:
    """The job's return is what a search (Hydra's Optuna sweeper) maximizes."""
    return float(run_job(cfg).get(OBJECTIVE, 0.0))


def main() -> None:
    """Entry for ``pdflow run`` (``pdflow.cli`` has set sys.argv to the overrides)."""
    sys.argv.append(f"hydra.job.name={JOB_NAME}")
    try:
        _run()
    finally:
        close_open_sweeps()
