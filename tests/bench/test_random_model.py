"""scripts/random_model.py: a real model's shape with random weights (the GPU benchmark's
stand-in where the weights cannot travel) keeps the config, applies overrides, copies the
tokenizer and loads in the engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_builds_the_shape_with_overrides_and_the_tokenizer(tiny_model_dir, tmp_path):
    like = tiny_model_dir("llama")
    out = tmp_path / "random"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "random_model.py"), str(out), "--like", str(like),
                    "--set", "num_hidden_layers=3", "--set", "intermediate_size=96", "--dtype", "bfloat16"],
                   check=True, capture_output=True, timeout=300)
    config = json.loads((out / "config.json").read_text())
    original = json.loads((like / "config.json").read_text())
    assert (config["num_hidden_layers"], config["intermediate_size"]) == (3, 96)
    assert config["hidden_size"] == original["hidden_size"] and config["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_bytes() == (like / "tokenizer.json").read_bytes()

    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        gate = f.get_tensor("model.layers.2.mlp.gate_proj.weight")
    assert gate.shape == (96, original["hidden_size"]) and str(gate.dtype) == "torch.bfloat16"
    assert gate.float().std() > 0, "weights left at zero"

    from pagedllm import LLM, SamplingParams

    llm = LLM(str(out), device="cpu", kv_cache_memory=1 << 22)
    result = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                          use_tqdm=False)
    assert len(result[0].outputs[0].token_ids) == 4
