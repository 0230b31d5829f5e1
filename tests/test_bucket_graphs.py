"""The capture order both CUDA-graph runners share (``BucketGraphs``): buckets largest
first, each prepared and warmed up outside its capture, every capture into the first
graph's memory pool on one capture stream of the runner's device, replays answering that
bucket's captured outputs. CUDA graphs need a
GPU, so the torch.cuda graph calls are recorded by stand-ins here; the graphs themselves
are checked on the H200 (tests/test_engine_triton_gpu.py, tests/test_drafted_graphs_gpu.py)."""

from __future__ import annotations

import contextlib

import torch

from pdflow.worker.cuda_graphs import BucketGraphs


class _Graph:
    made = 0

    def __init__(self):
        _Graph.made += 1
        self.name, self.replayed = f"pool-{_Graph.made}", 0

    def pool(self):
        return self.name

    def replay(self):
        self.replayed += 1


def test_buckets_capture_largest_first_into_one_pool(monkeypatch):
    events = []
    _Graph.made = 0

    streams = []

    class _Stream:  # the capture stream: made once, on the capturing device
        def __init__(self, device):
            streams.append(self)
            self.device = device

    @contextlib.contextmanager
    def capturing(graph, pool=None, stream=None, capture_error_mode=None):
        assert stream is streams[0] and stream.device == torch.device("cpu")
        events.append(("capture", pool))
        yield

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def prepare(bs):
        events.append(("prepare", bs))

        def step():
            events.append(("step", bs))
            return f"out-{bs}"
        return step

    graphs = BucketGraphs()
    graphs.capture([1, 4, 2], torch.device("cpu"), prepare)
    assert events == [("prepare", 4), ("step", 4), ("capture", None), ("step", 4),
                      ("prepare", 2), ("step", 2), ("capture", "pool-1"), ("step", 2),
                      ("prepare", 1), ("step", 1), ("capture", "pool-1"), ("step", 1)]
    assert len(streams) == 1  # one stream of the device for every bucket, not torch's per-process default
    assert graphs.replay(2) == "out-2" and graphs.graphs[2].replayed == 1 and graphs.graphs[4].replayed == 0
    graphs.release()
    assert not graphs.graphs and not graphs.outputs and graphs.pool is None
