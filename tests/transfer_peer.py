"""One instance of a P/D graph in its own process, for the two-process transfer tests.

    python tests/transfer_peer.py producer|consumer '{"overrides": [...], "num_blocks": 6,
                                                       "producers": {"0": "tcp://..."}}'

Prints one JSON line when ready (a producer: its ranks' side-channel addresses; a
consumer: that it paired), then serves until its stdin closes or it is killed. A
producer reads a request's producer block ids from its id: ``name:4.0.3``.
"""

from __future__ import annotations

import json
import sys

from transfer_kit import ConsumerSide, ProducerSide

from pdflow.graph import build_graph
from pdflow.spec.load import compose_spec
from pdflow.transfer.mooncake_engine import MooncakeTransport


def blocks_of(request_id: str) -> list[int]:
    return [int(b) for b in request_id.split(":")[1].split(".")]


def main(role: str, args: dict) -> None:
    import torch

    torch.set_num_threads(1)
    graph = build_graph(compose_spec(args["overrides"])).raise_if_refused()
    if role == "producer":
        side = ProducerSide(graph, args["num_blocks"], MooncakeTransport, blocks_of)
        print(json.dumps({"addresses": side.addresses}), flush=True)
    else:
        side = ConsumerSide(graph, args["num_blocks"], MooncakeTransport)
        side.pair({int(r): a for r, a in args["producers"].items()})
        print(json.dumps({"paired": True}), flush=True)
    sys.stdin.read()
    side.close()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
