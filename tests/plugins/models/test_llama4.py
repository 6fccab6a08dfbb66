"""Llama 4 text (Llama4ForCausalLM) against transformers on tiny random models: greedy tokens
and logprobs through plain, chunked-prefill, prefix-caching and preemption runs on TORCH
(a backend with chunked local attention) and briefly on TRITON (the other, interpreted);
CPU_ATTN refused for chunked models (and auto-selection on the CPU then picks TORCH), and
run on a variant without chunks.

The default model: 4 layers, MoE on layers 1 and 3 (interleave_moe_layer_step 2) with 4
experts top-1 and a shared expert, dense layers 0 and 2 of intermediate_size_mlp; layers
0-2 RoPE (llama3 scaling) + L2 q/k norm + chunked attention of 12 tokens (chunk edges fall
inside the 16-token blocks and inside chunked-prefill steps), layer 3 NoPE + global
attention + temperature tuning (floor_scale 4 so that it acts on short prompts)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests._models import cached_builds, reference, save_hf_model
from tests.test_llm import (
    NUM_TOKENS,
    PROMPT_LENS,
    assert_parity,
    hf_greedy,
    make_prompts,
    new_llm,
    run_engine,
)

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=40, intermediate_size_mlp=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=12, no_rope_layer_interval=4,
            attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, use_qk_norm=True,
            max_position_embeddings=512, initializer_range=0.3, bos_token_id=0, eos_token_id=1, pad_token_id=1,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=64))
MODELS = {
    "llama4": {},
    # top-2: each token's two copies are scaled by their own score before their experts
    "llama4-top2": dict(num_experts_per_tok=2, moe_layers=[0, 2, 3]),
    # no chunks (every layer global), no qk norm, no temperature tuning, NoPE on layer 1 only
    "llama4-global": dict(attention_chunk_size=None, use_qk_norm=False, attn_temperature_tuning=False,
                          no_rope_layers=[1, 0, 1, 1]),
}
CHUNKED_MODELS = ["llama4", "llama4-top2"]


def build(path, name: str, seed: int = 0):
    return save_hf_model(path, "Llama4ForCausalLM", "Llama4TextConfig", {**TINY, **MODELS[name]}, seed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return cached_builds(tmp_path_factory, build)


def with_config(src, dst, **changes):
    """A copy of model `src` (same weights) with config.json fields changed."""
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_reference_is_sensitive_and_consistent(model_dir, tmp_path):
    """Guards the parity tests: transformers' outputs are varied, depend on the chunk size
    and on the temperature tuning (so a mask or scale we got wrong would show), the
    checkpoint holds stacked experts in transformers' layout, and transformers' KV-cached
    loop (the reference) agrees with its full-sequence forward."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = model_dir("llama4")
    prompts = make_prompts()
    ref = reference(path, prompts)
    assert all(len(set(tokens)) > 4 for tokens, _ in ref)
    for i, changes in enumerate([dict(attention_chunk_size=16), dict(floor_scale=64)]):
        (tmp_path / str(i)).mkdir()
        other = hf_greedy(with_config(path, tmp_path / str(i), **changes), prompts)
        assert [t for t, _ in other] != [t for t, _ in ref], f"{changes} did not change transformers' output"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("model.layers.1.feed_forward.experts.gate_up_proj").get_shape()) == (4, 64, 80)
        assert tuple(f.get_slice("model.layers.1.feed_forward.experts.down_proj").get_shape()) == (4, 40, 64)
        assert "model.layers.0.feed_forward.gate_proj.weight" in f.keys()  # dense layer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, logprobs = ref[-1]  # the 100-token prompt: several chunks
    with torch.no_grad():
        logits = model(torch.tensor([prompts[-1] + tokens])).logits[0, len(prompts[-1]) - 1:-1]
    full = torch.log_softmax(logits.float(), -1)
    assert torch.allclose(full, torch.stack(logprobs), atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_parity_torch(model_dir, name):
    path = model_dir(name)
    prompts = make_prompts()
    outputs = run_engine(new_llm(path, attention_backend="TORCH"), prompts)
    assert_parity(outputs, reference(path, prompts))


def test_greedy_parity_cpu_attn_without_chunks(model_dir):
    """A Llama 4 config without attention chunks runs on the CPU default backend."""
    path = model_dir("llama4-global")
    prompts = make_prompts()
    llm = new_llm(path)
    assert llm.engine.worker.backend.name == "CPU_ATTN"
    assert_parity(run_engine(llm, prompts), reference(path, prompts))


@pytest.mark.parametrize("name", CHUNKED_MODELS)
def test_chunked_prefill_parity(model_dir, name):
    path = model_dir(name)
    prompts = make_prompts()
    llm = new_llm(path, attention_backend="TORCH", max_num_batched_tokens=16)
    outputs = run_engine(llm, prompts)
    assert_parity(outputs, reference(path, prompts))
    assert llm.engine.stats.num_steps > NUM_TOKENS + sum(PROMPT_LENS) // 16 - 1


def test_prefix_caching_parity(model_dir):
    path = model_dir("llama4")
    prompts = make_prompts(seed=1, lens=[5, 20, 33, 2], shared_prefix=70)
    llm = new_llm(path, attention_backend="TORCH")
    first = run_engine(llm, prompts[:1])
    rest = run_engine(llm, prompts[1:])
    assert_parity(first + rest, reference(path, prompts))
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 64 for o in rest), [o.num_cached_tokens for o in rest]


def test_preemption_parity(model_dir):
    path = model_dir("llama4")
    prompts = make_prompts(seed=2)
    # 4 layers x 2 kv heads x 16 dims x 4 bytes x 2 = 1024 bytes/token; 12 blocks of 16 tokens
    llm = new_llm(path, attention_backend="TORCH", kv_cache_memory=12 * 16 * 1024, max_model_len=160)
    outputs = run_engine(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_parity(outputs, reference(path, prompts))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_triton_interpreted_parity(model_dir):
    """TRITON's chunked kernels in the engine (interpreted: 2 prompts, 8 tokens): prefill in
    16-token steps across chunk edges after cached context, decodes crossing an edge."""
    from pagedllm import SamplingParams

    path = model_dir("llama4")
    prompts, num_tokens = make_prompts(seed=3, lens=[30, 7]), 8
    llm = new_llm(path, attention_backend="TRITON", max_num_batched_tokens=16)
    assert llm.engine.worker.backend.name == "TRITON"
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_parity(outputs, hf_greedy(path, prompts, num_tokens))


def test_cpu_attn_is_refused_for_chunked_attention(model_dir):
    with pytest.raises(ValueError, match=r"CPU_ATTN cannot run here: it does not support chunked local attention"
                                         r".*backends that do: TORCH, TRITON\)"):
        new_llm(model_dir("llama4"), attention_backend="CPU_ATTN")


def test_auto_selection_on_the_cpu_picks_torch(model_dir):
    llm = new_llm(model_dir("llama4"))
    assert llm.engine.worker.backend.name == "TORCH"
    # the cache facts behind it: layers 0-2 chunked, layer 3 global; no early block release
    spec = llm.engine.worker.kv_spec
    assert spec.attention_chunks == (12, 12, 12, None) and spec.chunked and spec.kv_window is None


def test_layers_follow_the_config(model_dir):
    from pagedllm.plugins.models.llama4 import Llama4DenseMLP, Llama4MoE

    layers = new_llm(model_dir("llama4")).engine.worker.model.model.layers
    assert [type(layer.feed_forward) for layer in layers] == [Llama4DenseMLP, Llama4MoE] * 2
    attn = [layer.self_attn for layer in layers]
    assert [a.use_rope for a in attn] == [True, True, True, False]
    assert [a.qk_norm for a in attn] == [True, True, True, False]
    assert [a.temperature_tuning for a in attn] == [False, False, False, True]
    assert [a.attn.impl.attention_chunk_size for a in attn] == [12, 12, 12, None]


def test_kv_cache_spec_checks_attention_chunks():
    from pagedllm.core.contracts import KVCacheSpec

    with pytest.raises(ValueError, match="attention_chunks names 1 layers, the model has 2"):
        KVCacheSpec(num_layers=2, num_heads=2, num_kv_heads=2, head_size=8, attention_chunks=(8,))
    spec = KVCacheSpec(num_layers=2, num_heads=2, num_kv_heads=2, head_size=8, attention_chunks=(8, None))
    assert spec.chunked and spec.chunk(0) == 8 and spec.chunk(1) is None
    assert not KVCacheSpec(num_layers=2, num_heads=2, num_kv_heads=2, head_size=8).chunked
