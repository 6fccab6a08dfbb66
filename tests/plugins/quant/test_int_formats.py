"""AWQ and GPTQ checkpoints written by tests/_int_quant.py (AutoAWQ's and AutoGPTQ's packing,
done independently of the plugins) against transformers running the dequantized weights:
greedy tokens equal, logprobs close. Covers 4 and 8 bits, symmetric and not, act-order,
skip lists, fused layers, and the errors a bad checkpoint must produce."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM
from pagedllm.core.contracts import QuantConfig
from tests.conftest import TEST_DEVICE, cpu_only
from tests._int_quant import quantized_checkpoint
from tests.test_llm import assert_parity, make_prompts, reference, run_engine

PROMPTS = make_prompts(3, lens=[5, 30, 12, 1])

CASES = {
    "awq-g32": dict(fmt="awq", group=32),
    "awq-g128": dict(fmt="awq", group=128, wide=True),
    "gptq-4bit-sym": dict(fmt="gptq", group=32, sym=True),
    "gptq-4bit-asym": dict(fmt="gptq", group=32),
    "gptq-4bit-act-order": dict(fmt="gptq", group=32, sym=True, act_order=True),
    "gptq-4bit-per-channel": dict(fmt="gptq", group=-1, sym=True),
    "gptq-8bit-sym": dict(fmt="gptq", bits=8, group=32, sym=True),
    "gptq-8bit-asym-act-order": dict(fmt="gptq", bits=8, group=32, act_order=True),
}


def build(tiny_model_dir, tmp_path, arch="llama", wide=False, **kw):
    src = tiny_model_dir(arch, **(dict(hidden_size=128, intermediate_size=256) if wide else {}))
    out, ref = tmp_path / "quant", tmp_path / "ref"
    quantized_checkpoint(src, out, ref, **kw)
    return out, ref


def engine(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device=TEST_DEVICE, kv_cache_memory=1 << 24, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers_on_the_dequantized_weights(tiny_model_dir, tmp_path, case):
    out, ref = build(tiny_model_dir, tmp_path, **CASES[case])
    llm = engine(out)
    assert_parity(run_engine(llm, PROMPTS), reference(ref, PROMPTS))


@cpu_only
@pytest.mark.parametrize("case", ["awq-g32", "gptq-4bit-act-order", "gptq-8bit-sym"])
def test_many_rows_decode_the_codes_into_the_gemm(tiny_model_dir, tmp_path, case, monkeypatch):
    """The GEMM path (codes decoded panel by panel, chosen from a measured row count) with
    its crossover forced to one row: every call takes it, and the parity holds."""
    from pagedllm.ops.cpu import crossover

    measured = crossover.rows_from
    monkeypatch.setattr(crossover, "rows_from",
                        lambda what, *a: 1 if "|rows|gemm|" in what else measured(what, *a))
    out, ref = build(tiny_model_dir, tmp_path, **CASES[case])
    llm = engine(out)
    qkv = llm.engine.worker.model.model.layers[0].self_attn.qkv_proj
    assert qkv.int_kernel.kind.startswith("native-") and qkv.int_kernel.gemm_from == 1
    assert_parity(run_engine(llm, PROMPTS), reference(ref, PROMPTS))


@cpu_only
def test_fused_layers_run_on_the_native_kernels(tiny_model_dir, tmp_path):
    out, _ = build(tiny_model_dir, tmp_path, fmt="gptq", group=32, sym=True, act_order=True)
    model = engine(out).engine.worker.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.int_kernel.kind.startswith("native-int4"), qkv.int_kernel.kind
    assert not hasattr(qkv, "qweight"), "the checkpoint's packed tensors are dropped after repacking"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures(tiny_model_dir, tmp_path, arch):
    out, ref = build(tiny_model_dir, tmp_path, arch=arch, fmt="awq", group=32)
    assert_parity(run_engine(engine(out), PROMPTS), reference(ref, PROMPTS))


def test_skip_list_leaves_layers_float(tiny_model_dir, tmp_path):
    out, ref = build(tiny_model_dir, tmp_path, fmt="awq", group=32, skip=("down_proj",))
    llm = engine(out)
    layer = llm.engine.worker.model.model.layers[1].mlp
    assert not hasattr(layer.down_proj, "int_kernel") and hasattr(layer.gate_up_proj, "int_kernel")
    assert_parity(run_engine(llm, PROMPTS), reference(ref, PROMPTS))


def test_skip_list_splitting_a_fused_layer_is_refused(tiny_model_dir, tmp_path):
    out, _ = build(tiny_model_dir, tmp_path, fmt="awq", group=32, skip=("k_proj",))
    with pytest.raises(ValueError, match=r"k_proj.*fused layer.*qkv_proj"):
        engine(out)


def _rewrite_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_bad_checkpoints_fail_with_what_to_change(tiny_model_dir, tmp_path):
    out, ref = build(tiny_model_dir, tmp_path, fmt="gptq", group=32, sym=True)
    with pytest.raises(ValueError, match=r"--quantization awq.*saved as 'gptq'"):
        engine(out, quantization="awq")
    with pytest.raises(ValueError, match=r"--quantization gptq needs a checkpoint saved in that format"):
        engine(ref, quantization="gptq")
    _rewrite_config(out, group_size=16)
    with pytest.raises(ValueError, match=r"qweight_?|scales|qzeros"):
        engine(out)
    _rewrite_config(out, group_size=32, quant_method="nope")
    with pytest.raises(ValueError, match=r"unknown quantization 'nope'; available here: .*awq.*gguf.*gptq"):
        engine(out)
    _rewrite_config(out, quant_method="gptq", bits=3)
    with pytest.raises(ValueError, match="3-bit"):
        engine(out)


def test_vllm_kernel_names_select_the_format(tiny_model_dir, tmp_path):
    out, ref = build(tiny_model_dir, tmp_path, fmt="awq", group=32)
    llm = engine(out, quantization="awq_marlin")
    assert_parity(run_engine(llm, PROMPTS[:1]), reference(ref, PROMPTS[:1]))


def test_skip_names_match_whole_components():
    class Q(QuantConfig):
        name = "t"

        @classmethod
        def from_config(cls, config, options):
            return cls()

        def linear_method(self, prefix):
            return None

    q = Q()
    q.bind({"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)})
    assert q.checkpoint_names("model.layers.0.self_attn.qkv_proj") == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    assert q.is_skipped("model.layers.0.self_attn.qkv_proj", ["self_attn"])
    assert q.is_skipped("model.layers.1.mlp.down_proj", ["re:.*layers\\.1\\..*"])
    assert not q.is_skipped("model.layers.10.mlp.down_proj", ["layers.1"])
    assert not q.is_skipped("model.layers.0.mlp.down_proj", ["proj"])


# --------------------------------------------------------------------------- the real SmolLM2

SMOL_CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
              "def fib(n):\n    # complete this Python function", "Explain in one sentence why the sky is blue."]
SMOL_TOKENS = 24


@pytest.mark.slow
@pytest.mark.parametrize("case", ["awq", "gptq-act-order"])
def test_smollm2_matches_transformers_on_the_dequantized_weights(smollm2_float, tmp_path, case):
    """SmolLM2's hidden size (576) takes groups of 64."""
    from transformers import AutoModelForCausalLM

    kw = dict(fmt="awq", group=64) if case == "awq" else dict(fmt="gptq", group=64, sym=True, act_order=True)
    out, ref = tmp_path / "quant", tmp_path / "ref"
    quantized_checkpoint(smollm2_float, out, ref, **kw)
    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory=1 << 26, max_model_len=512)
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in SMOL_CHATS]
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=SMOL_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    for i, (prompt, got) in enumerate(zip(prompts, outputs)):
        tokens = got.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0]
        rows = torch.log_softmax(logits.double(), -1)[len(prompt) - 1:-1]
        assert tokens == rows.argmax(-1).tolist(), f"chat {i}: greedy tokens differ from transformers"
        ours = torch.tensor([next(iter(s.values())).logprob for s in got.outputs[0].logprobs], dtype=torch.float64)
        expected = rows.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        assert (ours - expected).abs().max().item() < 2e-3, f"chat {i}: logprobs differ from transformers"


