"""compressed-tensors checkpoints written by the compressed-tensors library itself
(llm-compressor's saving path: apply a scheme, set each layer's scales, compress), run
against transformers on the weights the library's own fake_quantize gives."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("compressed_tensors")

from pagedllm import LLM  # noqa: E402
from tests.test_llm import assert_parity, make_prompts, reference, run_engine  # noqa: E402

PROMPTS = make_prompts(5, lens=[7, 25, 1])


def write_checkpoint(src, out, ref, bits=4, strategy="group", group=32, symmetric=True, ignore=("lm_head",)):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group if strategy == "group" else None)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=list(ignore), format="pack-quantized")
    apply_quantization_config(model, config)
    dequantized = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and hasattr(m, "weight_scale"):
            w = m.weight.data
            blocks = w.view(w.shape[0], -1, group) if strategy == "group" else w.view(w.shape[0], 1, -1)
            scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
            m.weight_scale.data.copy_(scale)
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zero)
            dequantized[name + ".weight"] = fake_quantize(w, m.weight_scale.data, m.weight_zero_point.data, args)
    reference_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = reference_model.state_dict()
    for name, w in dequantized.items():
        state[name].copy_(w)
    reference_model.save_pretrained(ref)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for d in (out, ref):
        (d / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
        for f in src.glob("tokenizer_config.json"):
            (d / f.name).write_bytes(f.read_bytes())
        for f in src.glob("special_tokens_map.json"):
            (d / f.name).write_bytes(f.read_bytes())


CASES = {
    "w4a16-group-sym": {},
    "w4a16-group-asym": {"symmetric": False},
    "w4a16-channel": {"strategy": "channel"},
    "w8a16-group-sym": {"bits": 8},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pack_quantized_matches_transformers_on_the_dequantized_weights(tiny_model_dir, tmp_path, case):
    out, ref = tmp_path / "ct", tmp_path / "ref"
    write_checkpoint(tiny_model_dir("llama"), out, ref, **CASES[case])
    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory=1 << 24)
    layer = llm.engine.worker.model.model.layers[0].mlp.gate_up_proj
    assert layer.int_kernel.kind.startswith("native"), layer.int_kernel.kind
    assert_parity(run_engine(llm, PROMPTS), reference(ref, PROMPTS))


def test_w8a8_is_refused_until_its_kernels_exist(tiny_model_dir, tmp_path):
    out, ref = tmp_path / "ct", tmp_path / "ref"
    write_checkpoint(tiny_model_dir("llama"), out, ref)
    cfg = json.loads((out / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["format"] = cfg["quantization_config"]["format"] = "int-quantized"
    group["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="int-quantized.*not supported yet"):
        LLM(str(out), dtype="float32", device="cpu", kv_cache_memory=1 << 24)
