"""The shipped checkpoint loads with transformers and is what the model card says.

The checkpoint test loads the trained model committed in pdflow/assets/tiny and checks it
solves held-out problems; the smoke test runs scripts/train_target.py --smoke end to end
(train, save, load, eval, pack).
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "pdflow" / "assets" / "tiny"
SHARD_LIMIT = 12 * 1024 * 1024


def _tiny_yaml() -> dict[str, str]:
    lines = (ROOT / "conf/model/tiny.yaml").read_text().splitlines()
    pairs = (line.split(":", 1) for line in lines if ":" in line)
    return {k.strip(): v.strip() for k, v in pairs if v.strip() and not k.startswith(("#", " ", "-"))}


def _check_files(ckpt: Path) -> None:
    shards = sorted(ckpt.glob("*.safetensors"))
    assert len(shards) >= 2, "sharded on purpose, to exercise sharded loading"
    assert all(s.stat().st_size < SHARD_LIMIT for s in shards)
    assert sum(s.stat().st_size for s in shards) < 30 * 1024 * 1024
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "pdflow_training.json"):
        assert (ckpt / name).is_file(), name
    # Computed in fp32 whoever loads it (tests/test_model_dtype.py), stored bf16.
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "float32"


def _load(ckpt: Path):
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return tok, model


def _check_geometry(model, tok) -> None:
    spec = _tiny_yaml()
    cfg = model.config
    assert cfg.architectures == [spec["architecture"]]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == tuple(
        int(spec[k]) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"))
    assert cfg.max_position_embeddings >= int(spec["max_model_len"]) >= 4096
    assert len(tok) == cfg.vocab_size


def test_shipped_checkpoint_loads_and_solves():
    from pdflow.bench.tasks import arith_eval_set, retrieval_eval_set, score_arith, score_retrieval

    _check_files(ASSET)
    tok, model = _load(ASSET)
    _check_geometry(model, tok)
    assert (ASSET / "README.md").is_file()
    seq_len = json.loads((ASSET / "pdflow_training.json").read_text())["seq_len"]
    items = arith_eval_set(6, seed=77, max_context=seq_len)
    samples = retrieval_eval_set(context_len=seq_len, per_depth=1, seed=77)
    tok.padding_side = "left"
    solved = 0
    for it in items:  # one at a time: no padding involved, greedy as in the eval
        enc = tok(it.prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=200, do_sample=False, pad_token_id=tok.pad_token_id,
                             stop_strings=["\n\n"], tokenizer=tok)
        solved += score_arith(tok.decode(out[0, enc["input_ids"].shape[1]:]), it.answer).strict
    assert solved >= 5, f"{solved}/6 held-out problems solved"
    enc = tok([s.prompt for s in samples], return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert sum(score_retrieval(t, s.answer) for t, s in zip(texts, samples, strict=True)) >= 4


def test_smoke_training_end_to_end(tmp_path):
    ckpt, packed, restored = tmp_path / "ckpt", tmp_path / "packed", tmp_path / "restored"

    def run(*cmd):
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=120)

    run(sys.executable, "scripts/train_target.py", "--smoke", "--out", str(ckpt))
    _check_files(ckpt)
    record = json.loads((ckpt / "pdflow_training.json").read_text())
    assert record["steps"] == 4 and record["smoke"]
    tok, model = _load(ckpt)
    _check_geometry(model, tok)
    enc = tok(["Question: Tom has 3 pens.", "Hi"], return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (2, enc["input_ids"].shape[1] + 3)

    report = tmp_path / "eval.json"
    run(sys.executable, "scripts/eval_target.py", "--ckpt", str(ckpt), "--n", "2", "--k-shot", "1",
        "--arith-context", "2048", "--retrieval-len", "256", "--retrieval-per-depth", "1",
        "--max-new-tokens", "8", "--json", str(report))
    result = json.loads(report.read_text())
    assert result["arith"]["n"] == 2 and set(result["retrieval"]["by_depth"]) == {
        "0.01", "0.25", "0.5", "0.75", "0.99"}

    run("bash", "scripts/pack_target.sh", str(ckpt), str(packed))
    assert all(p.stat().st_size < SHARD_LIMIT for p in packed.iterdir())
    run("bash", "scripts/unpack_target.sh", str(packed), str(restored))
    for f in ckpt.iterdir():
        assert (restored / f.name).read_bytes() == f.read_bytes(), f.name
