"""bitsandbytes checkpoints written with the bitsandbytes library (its quantize_4bit /
int8_vectorwise_quant and the quant state's own serialization, as transformers saves
them), against transformers on the library's dequantized weights."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("bitsandbytes")

from pagedllm import LLM  # noqa: E402
from tests.conftest import TEST_DEVICE  # noqa: E402
from tests._checkpoints import split_linears, write_pair  # noqa: E402
from tests.test_llm import assert_parity, make_prompts, reference, run_engine  # noqa: E402

PROMPTS = make_prompts(17, lens=[6, 28, 1])


def write_checkpoint(src, out, ref, bits=4, quant_type="nf4", double_quant=True, blocksize=64):
    import bitsandbytes.functional as bnbf
    quant, dense, linears = split_linears(src)
    for name, prefix, w in linears:
        if bits == 4:
            q, state = bnbf.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type,
                                          compress_statistics=double_quant)
            dense[name] = bnbf.dequantize_4bit(q, state).float()
            quant[name] = q
            for key, value in state.as_dict(packed=True).items():
                quant[f"{name}.{key}"] = value
        else:
            codes, scb, _ = bnbf.int8_vectorwise_quant(w)
            dense[name] = codes.float() * scb[:, None] / 127.0
            quant[name], quant[f"{prefix}.SCB"] = codes, scb
    qc = {"quant_method": "bitsandbytes", "load_in_4bit": bits == 4, "load_in_8bit": bits == 8,
          "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": double_quant,
          "bnb_4bit_compute_dtype": "float32"}
    write_pair(src, out, ref, quant, dense, qc)


CASES = {
    "nf4-double-quant": {},
    "nf4": {"double_quant": False},
    "fp4": {"quant_type": "fp4"},
    "int8": {"bits": 8},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers_on_the_dequantized_weights(tiny_model_dir, tmp_path, case):
    out, ref = tmp_path / "bnb", tmp_path / "ref"
    write_checkpoint(tiny_model_dir("llama"), out, ref, **CASES[case])
    llm = LLM(str(out), dtype="float32", device=TEST_DEVICE, kv_cache_memory=1 << 24, load_format="bitsandbytes")
    assert_parity(run_engine(llm, PROMPTS), reference(ref, PROMPTS))


def test_in_flight_nf4_matches_the_library(tiny_model_dir, tmp_path):
    """`--quantization bitsandbytes` on a float checkpoint quantizes to NF4 as it loads:
    the same codes as bitsandbytes' quantize_4bit (blocks of 64), so transformers on the
    library's dequantized weights is the reference."""
    import bitsandbytes.functional as bnbf

    from pagedllm.plugins.quant.bitsandbytes import NF4, quantize_nf4

    w = torch.randn(64, 128)
    q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(state.code.float(), torch.tensor(NF4)), "our NF4 table is bitsandbytes' quant_map"
    codes, absmax = quantize_nf4(w)
    flat = q.reshape(-1)
    theirs = torch.stack(((flat >> 4) & 0xF, flat & 0xF), dim=1).reshape(64, 128)
    assert (codes == theirs).float().mean() > 0.999 and torch.allclose(absmax.reshape(-1), state.absmax)
    src = tiny_model_dir("llama")
    write_checkpoint(src, tmp_path / "unused", tmp_path / "ref", double_quant=False)
    llm = LLM(str(src), dtype="float32", device=TEST_DEVICE, kv_cache_memory=1 << 24, quantization="bitsandbytes")
    layer = llm.engine.worker.model.model.layers[0].self_attn.qkv_proj
    assert len(layer.bnb_kernels) == 3, "q, k and v run on the native codebook kernel"
    assert_parity(run_engine(llm, PROMPTS), reference(tmp_path / "ref", PROMPTS))


def test_an_incomplete_layer_is_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    out, ref = tmp_path / "bnb", tmp_path / "ref"
    write_checkpoint(tiny_model_dir("llama"), out, ref)
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight.absmax"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight is incomplete"):
        LLM(str(out), dtype="float32", device=TEST_DEVICE, kv_cache_memory=1 << 24)
