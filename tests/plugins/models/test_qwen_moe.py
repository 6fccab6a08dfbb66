"""Qwen3-MoE and Qwen2-MoE against transformers on tiny random models: greedy tokens and
logprobs through plain, chunked-prefill, prefix-caching and preemption runs, on the TORCH
and CPU_ATTN attention backends (TRITON instead on a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests._models import cached_builds, reference, save_hf_model
from tests.conftest import NATIVE_BACKEND
from tests.test_llm import (
    NUM_TOKENS,
    PROMPT_LENS,
    assert_parity,
    make_prompts,
    new_llm,
    run_engine,
)

BACKENDS = ["TORCH", NATIVE_BACKEND]
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, initializer_range=0.3, bos_token_id=0, eos_token_id=1, pad_token_id=1,
            tie_word_embeddings=False)
MODELS = {
    # every layer sparse, top-2 of 8, probabilities not renormalized (Qwen3-MoE's default)
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(head_dim=16, decoder_sparse_step=1)),
    # layer 0 dense (mlp_only_layers), renormalized top-k
    "qwen3moe-mlp-only": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                          dict(head_dim=16, mlp_only_layers=[0], norm_topk_prob=True)),
    # shared expert gated by a sigmoid, qkv bias; layer 0 dense by decoder_sparse_step=2
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                 dict(shared_expert_intermediate_size=48, decoder_sparse_step=2, num_hidden_layers=2)),
    "qwen2moe-sparse": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                        dict(shared_expert_intermediate_size=48, norm_topk_prob=True)),
    # qkv_bias false: no q/k/v bias (Qwen2-MoE's attention follows the config)
    "qwen2moe-no-bias": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                         dict(shared_expert_intermediate_size=48, qkv_bias=False)),
}


def build(path, name: str, seed: int = 0):
    cls, cfg_cls, extra = MODELS[name]
    return save_hf_model(path, cls, cfg_cls, {**TINY, **extra}, seed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return cached_builds(tmp_path_factory, build)


def test_checkpoints_are_per_expert_and_models_not_degenerate(model_dir):
    """Guards the parity tests: the saved names are the per-expert ones the mapper reads, and
    random models that repeat one token would prove nothing."""
    from safetensors import safe_open

    path = model_dir("qwen2moe")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.shared_expert_gate.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # dense layer (decoder_sparse_step=2)
    for name in ("qwen3moe", "qwen2moe"):
        assert all(len(set(tokens)) > 4 for tokens, _ in reference(model_dir(name), make_prompts()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_parity(model_dir, name, backend):
    path = model_dir(name)
    prompts = make_prompts()
    outputs = run_engine(new_llm(path, attention_backend=backend), prompts)
    assert_parity(outputs, reference(path, prompts))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_chunked_prefill_parity(model_dir, name, backend):
    path = model_dir(name)
    prompts = make_prompts()
    llm = new_llm(path, attention_backend=backend, max_num_batched_tokens=16)
    outputs = run_engine(llm, prompts)
    assert_parity(outputs, reference(path, prompts))
    assert llm.engine.stats.num_steps > NUM_TOKENS + sum(PROMPT_LENS) // 16 - 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_prefix_caching_parity(model_dir, name, backend):
    path = model_dir(name)
    prompts = make_prompts(seed=1, lens=[5, 20, 33, 2], shared_prefix=70)
    llm = new_llm(path, attention_backend=backend)
    first = run_engine(llm, prompts[:1])
    rest = run_engine(llm, prompts[1:])
    assert_parity(first + rest, reference(path, prompts))
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 64 for o in rest), [o.num_cached_tokens for o in rest]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_preemption_parity(model_dir, name, backend):
    path = model_dir(name)
    prompts = make_prompts(seed=2)
    # 2 layers x 2 kv heads x 16 dims x 4 bytes x 2 = 512 bytes/token; 12 blocks of 16 tokens
    llm = new_llm(path, attention_backend=backend, kv_cache_memory=12 * 16 * 512, max_model_len=160)
    outputs = run_engine(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_parity(outputs, reference(path, prompts))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_layers_follow_the_sparse_rule(model_dir):
    from pagedllm.plugins.models.llama import LlamaMLP
    from pagedllm.plugins.models.qwen_moe import (
        Qwen2MoeSparseBlock,
        Qwen3MoeSparseBlock,
    )

    llm = new_llm(model_dir("qwen3moe-mlp-only"))
    layers = llm.engine.worker.model.model.layers
    assert isinstance(layers[0].mlp, LlamaMLP) and isinstance(layers[1].mlp, Qwen3MoeSparseBlock)
    llm = new_llm(model_dir("qwen2moe"))
    layers = llm.engine.worker.model.model.layers
    assert isinstance(layers[0].mlp, LlamaMLP) and isinstance(layers[1].mlp, Qwen2MoeSparseBlock)


def test_missing_expert_is_an_error(model_dir, tmp_path):
    """A checkpoint without one expert's tensor fails at load, naming what is missing."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = model_dir("qwen3moe")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.zeros(31, 64)  # wrong shape
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj"):
        new_llm(tmp_path)


def test_unfilled_expert_is_an_error(model_dir, tmp_path):
    """One expert's tensor absent: the stacked parameter is partly filled, which the layer
    refuses by name (the loader alone would see the parameter as loaded)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = model_dir("qwen3moe")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.gate_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.5\.gate_proj\.weight"):
        new_llm(tmp_path)


FP8_CASES = {"per-tensor": {}, "per-tensor-static": "static", "block": {"block": (16, 16)}}


@pytest.mark.parametrize("case", sorted(FP8_CASES))
def test_fp8_experts_match_transformers_on_the_dequantized_weights(model_dir, tmp_path, case, monkeypatch):
    """FP8 checkpoints (experts included): our engine (dense layers W8A8, experts fp8
    weights with float activations) against transformers on the dequantized weights with
    the dense projections' inputs rounded to fp8 the same way (its 3-D experts take no
    hook, as ours take float activations)."""
    monkeypatch.setenv("PAGEDLLM_FP8_ACTIVATIONS", "fp8")  # the dense layers as W8A8 (the CPU default: W8A16)
    from tests._fp8_quant import (
        engine_log_likelihoods,
        fp8_checkpoint,
        hf_log_likelihoods,
    )

    src = model_dir("qwen2moe-sparse")
    ids = make_prompts(11, lens=[96])[0]
    kwargs = dict(static_ids=ids[:48]) if FP8_CASES[case] == "static" else FP8_CASES[case]
    activations = fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", **kwargs)
    llm = new_llm(tmp_path / "fp8")
    experts = llm.engine.worker.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w2_weight.dtype == torch.float8_e4m3fn
    diff = (engine_log_likelihoods(llm, ids) - hf_log_likelihoods(tmp_path / "ref", ids, activations)).abs()
    assert diff.median().item() < 1e-4 and diff.mean().item() < 0.05, (diff.median(), diff.mean())


def test_quantization_flag_quantizes_experts_while_loading(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FP8_ACTIVATIONS", "fp8")  # the dense layers as W8A8 (the CPU default: W8A16)
    from tests._fp8_quant import (
        engine_log_likelihoods,
        fp8_checkpoint,
        hf_log_likelihoods,
    )

    src = model_dir("qwen3moe")
    ids = make_prompts(12, lens=[96])[0]
    llm = new_llm(src, quantization="fp8")
    experts = llm.engine.worker.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert experts.w13_row_scale.shape == (8, 64) and bool((experts.w13_row_scale > 0).all())
    activations = fp8_checkpoint(src, tmp_path / "unused", tmp_path / "ref", per_row=True)
    diff = (engine_log_likelihoods(llm, ids) - hf_log_likelihoods(tmp_path / "ref", ids, activations)).abs()
    assert diff.median().item() < 1e-4 and diff.mean().item() < 0.05, (diff.median(), diff.mean())


def test_other_quantized_formats_refuse_experts(model_dir, tmp_path):
    """A format without a MoE method fails at start-up naming it (the base QuantConfig
    default), rather than loading quantized expert tensors as dense garbage."""
    import json
    import shutil

    src = model_dir("qwen3moe")
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                  "desc_act": False}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="'gptq' does not support mixture-of-experts"):
        new_llm(tmp_path / "m")
