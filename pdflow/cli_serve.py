"""``pdflow serve [-v] [hydra overrides...]``: plan, start, wait for /health, print the URL,
serve until Ctrl-C or SIGTERM, then stop everything and exit 0. ``-v`` lets the transfer
engine's own log lines through.

By default the spec's deployment (prefill and decode instances driven from this process)
on ``serve.host:serve.port``; with ``serve.backends=[URL,...]`` a router over instances
started elsewhere. Instances started as separate commands, on one host or several:

    pdflow serve role=decode  serve.port=8200 [overrides]
    pdflow serve role=prefill serve.port=8100 [the same overrides]
    pdflow serve role=router  serve.port=8000 serve.prefill=[http://HOST:8100] \
        serve.decode=[http://HOST:8200]

(``role=`` is short for ``serve.role=``.) Each instance is its own process group; the
router refuses instances that describe different run graphs (RunGraphMismatch).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

import hydra
from omegaconf import DictConfig

from pdflow.graph import GraphRefused, build_graph
from pdflow.graph.host import HostFacts, host_refusals, read_devices
from pdflow.spec.load import spec_from_config

CONFIG_PATH = "pkg://pdflow.conf"
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def serve_until_signalled(spec, stop: threading.Event) -> int:
    """0 once signalled; 3 when the engine-core process died (the server failed)."""
    from pdflow.serve.launch import serve_spec

    with serve_spec(spec) as served:
        role = spec.serve.role
        if served.backends:
            what = f"router over {', '.join(served.backends)}"
        elif role in ("prefill", "decode"):
            what = f"the {role} instance of model {served.model_name}"
        else:
            what = f"model {served.model_name}"
        auth = " (API key required)" if served.api_key else ""
        print(f"pdflow serve: {what} at {served.url}/v1{auth}; Ctrl-C stops", flush=True)
        while not stop.wait(0.5):
            if served.failure() is not None:
                print(f"pdflow serve: {served.failure()}; stopping", file=sys.stderr, flush=True)
                return 3
        print("pdflow serve: stopping", flush=True)
    return 0


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def _serve(cfg: DictConfig) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    spec = spec_from_config(cfg)
    if not spec.serve.backends and spec.serve.role != "router":
        graph = build_graph(spec, read_devices(spec)).raise_if_refused()
        refusals = host_refusals(graph, HostFacts.probe(spec))
        if refusals:
            raise GraphRefused(refusals)
    from pdflow.serve.launch import api_key_of

    if spec.serve.host not in LOOPBACK and not api_key_of(spec):
        print(f"pdflow serve: warning: {spec.serve.host} is reachable from the network and no API key "
              "is set (serve.api_key or $PDFLOW_API_KEY)", file=sys.stderr)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = serve_until_signalled(spec, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("pdflow serve: stopped", flush=True)
    if code:
        sys.exit(code)


def main() -> None:
    """Entry for ``pdflow serve`` (``pdflow.cli`` has set sys.argv to the overrides)."""
    sys.argv = [("serve." + a) if a.startswith("role=") else a for a in sys.argv]
    _serve()
