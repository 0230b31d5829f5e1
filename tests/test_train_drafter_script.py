"""scripts/train_drafter.py end to end on CPU (--smoke): trains a few steps of each
drafter against the shipped target, saves HF-style folders with a card, and what it
saves loads where the graph places it and drafts through the paged path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from specdec_helpers import TargetRunner

from pdflow.attention.backends import get_backend
from pdflow.attention.kv_cache import KVCacheBinding
from pdflow.bench.tasks import vocab as V
from pdflow.graph import build_graph
from pdflow.model.loader import build_model, model_config
from pdflow.spec.load import compose_spec
from pdflow.spec_decode import ProposeBatch, load_drafter

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_training_saves_loadable_drafters(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "scripts/train_drafter.py", "--smoke", "--steps", "2", "--out-root",
                    str(tmp_path)], cwd=ROOT, env=env, check=True, timeout=600)
    for kind in ("dspark", "eagle", "eagle3"):
        assert json.loads((tmp_path / f"tiny-{kind}" / "pdflow_training.json").read_text())["steps"] == 2
    check_drafters(tmp_path)


def check_drafters(root: Path) -> None:
    spec = compose_spec(["prefill=tp1", "decode=tp1", "decode.block_size=32", "decode.kv_page_tokens=16",
                         "tracking=off"])
    folder, cfg = model_config(spec.model)
    target = build_model(cfg, folder=folder, dtype=torch.float32, device=torch.device("cpu"))
    ids = torch.tensor([V.BOS_ID, *V.encode("Question: Mia has 3 pens and buys 4 more.")])
    for kind in ("dspark", "eagle", "eagle3"):
        out = root / f"tiny-{kind}"
        for name in ("config.json", "model.safetensors", "README.md", "pdflow_training.json"):
            assert (out / name).is_file(), (kind, name)
        record = json.loads((out / "pdflow_training.json").read_text())
        assert record["smoke"] and record["eval"]["k"] == 7
        assert "SMOKE RUN" in (out / "README.md").read_text()
        graph = build_graph(compose_spec([f"drafter={kind}", "prefill=tp1", "decode=tp1",
                                          "decode.block_size=32", "decode.kv_page_tokens=16", "tracking=off"]))
        plan = graph.rank("decode", 0)
        drafter = load_drafter(out, plan.units)
        drafter.config.check_run(spec=graph.spec.drafter, target=cfg, graph_taps=graph.drafter.taps)
        drafter.bind_target(target.model.embed_tokens, target.lm_head)
        pool = KVCacheBinding([u for u in plan.units if u.family == "draft"], 4, torch.device("cpu"))
        drafter.bind_cache(pool.caches, get_backend("torch"))
        runner = TargetRunner(target, cfg, taps=drafter.tap_layers, blocks=[2, 0], num_blocks=4)
        with torch.no_grad():
            hidden, taps, logits = runner.forward(ids, 0)
            feats = taps if drafter.tap_layers else hidden
            drafter.write_context_kv(runner.context("r", ids, 0, feats))
            drafter.commit(["r"], [len(ids)])
            prop = drafter.propose(ProposeBatch(
                seq_ids=["r"], anchor_ids=logits[-1:].argmax(-1), anchor_positions=[len(ids)],
                block_tables=torch.tensor([[2, 0]], dtype=torch.int32), num_drafts=7,
                anchor_features=feats[-1:],
            ))
        assert prop.tokens.shape == (1, 7) and torch.isfinite(prop.logits).all()
