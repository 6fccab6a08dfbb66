"""--trust-remote-code reaches transformers: a checkpoint whose config class lives in its
own repository (`auto_map`) loads with it, and without it fails naming the flag."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedllm import LLM, SamplingParams

CONFIG_CODE = '''
from transformers import LlamaConfig


class ToyConfig(LlamaConfig):
    model_type = "pagedllm_toy"
'''


def test_remote_config_code_needs_the_flag(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "remote"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    (model_dir / "configuration_toy.py").write_text(CONFIG_CODE)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="pagedllm_toy", auto_map={"AutoConfig": "configuration_toy.ToyConfig"})
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--trust-remote-code"):
        LLM(str(model_dir), dtype="float32", device="cpu", enforce_eager=True)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enforce_eager=True, trust_remote_code=True)
    assert type(llm.engine.hf_config).__name__ == "ToyConfig"
    reference = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [3, 8, 22, 9]}]
    assert (llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids ==
            reference.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
