"""``model.path`` and ``LLM(...)`` take a Hugging Face hub id, resolved through
huggingface_hub's cache. Offline only: a cache laid out as the hub lays it out
(``models--org--name/snapshots/<commit>/`` + ``refs/<revision>``) holds the shipped tiny
checkpoint, ``HF_HUB_CACHE`` points at it and ``HF_HUB_OFFLINE=1``, so nothing downloads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdflow import LLM, SamplingParams
from pdflow.graph import build_graph
from pdflow.model.paths import resolve_model_path
from pdflow.spec import ParallelSpec
from pdflow.spec.load import compose_spec

TINY = resolve_model_path("pdflow:assets/tiny")
MAIN, OLD = "a" * 40, "b" * 40
REPO = "pdflow-test/tiny"


def _snapshot(cache: Path, commit: str, ref: str, layers: int | None = None) -> Path:
    repo = cache / f"models--{REPO.replace('/', '--')}"
    folder = repo / "snapshots" / commit
    shutil.copytree(TINY, folder)
    if layers is not None:  # a marked revision: its config says another depth
        text = (folder / "config.json").read_text()
        (folder / "config.json").write_text(text.replace('"num_hidden_layers": 8', f'"num_hidden_layers": {layers}'))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return folder


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    _snapshot(cache, MAIN, "main")
    _snapshot(cache, OLD, "v0", layers=4)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants  # read at import: follow the env here

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot_at_a_revision(hub_cache):
    assert resolve_model_path(REPO) == hub_cache / f"models--pdflow-test--tiny/snapshots/{MAIN}"
    assert resolve_model_path(REPO, "v0").name == OLD


def test_model_hf_takes_its_geometry_and_name_from_a_hub_id(hub_cache):
    spec = compose_spec(["model=hf", f"model.path={REPO}", "mode=monolithic", "decode=tp1", "drafter=none"])
    assert (spec.model.name, spec.model.layers, spec.model.kv_heads) == ("tiny", 8, 4)
    old = compose_spec(["model=hf", f"model.path={REPO}", "model.revision=v0", "mode=monolithic",
                        "decode=tp1", "drafter=none"])
    assert old.model.layers == 4  # the revision's own config, not main's
    assert build_graph(spec).refusals == ()


def test_a_hub_id_not_in_the_cache_offline_is_a_file_not_found_naming_it(hub_cache):
    with pytest.raises(FileNotFoundError, match="pdflow-test/absent.*HF_HUB_OFFLINE"):
        resolve_model_path("pdflow-test/absent")


def test_llm_serves_a_hub_id_as_it_serves_the_folder(hub_cache):
    prompt, params = "Question: 3 + 4 =", SamplingParams(temperature=0, max_tokens=8)
    with LLM(str(TINY), ParallelSpec()) as llm:
        want = llm.generate(prompt, params)[0].token_ids
    with LLM(REPO, ParallelSpec()) as llm:
        assert llm.engine.instance.spec.model.name == "tiny"
        assert llm.generate(prompt, params)[0].token_ids == want
