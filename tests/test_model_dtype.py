"""The shipped model runs in one dtype however it is loaded.

Decision: the tiny model is computed in fp32 (it is trained for it, CPU runs it, the fused
CPU decode op is fp32) and stored in bf16. Its config.json says ``"dtype": "float32"``
(the dtype to compute in), so ``LLM("pdflow:assets/tiny")`` with ``dtype="auto"``,
``conf/model/tiny.yaml`` (``dtype: fp32``, ``weight_dtype: bf16``) and transformers'
default load all agree; the shards' bf16 is what tiny.yaml's ``weight_dtype`` says.
"""

from __future__ import annotations

import torch
import transformers
from safetensors import safe_open

from pdflow import LLM
from pdflow.model.paths import resolve_model_path
from pdflow.spec.load import compose_spec

MODEL = "pdflow:assets/tiny"
SAFETENSORS_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def test_llm_auto_dtype_and_the_tiny_config_agree():
    configured = compose_spec(["model=tiny"]).model
    with LLM(MODEL) as llm:
        served = llm.engine.spec.model
        params = {p.dtype for p in llm.instance.executor.stage.model.parameters()}
    assert served.dtype == configured.dtype == "fp32"
    assert served.kv_dtype == configured.kv_dtype
    assert params == {torch.float32}


def test_transformers_default_load_and_stored_weights_agree_with_the_tiny_config():
    configured = compose_spec(["model=tiny"]).model
    folder = resolve_model_path(MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert hf.dtype == torch.float32
    stored = set()
    for shard in folder.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            stored |= {SAFETENSORS_DTYPES[f.get_slice(name).get_dtype()] for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert stored == {configured.weight_dtype} == {"bf16"}
