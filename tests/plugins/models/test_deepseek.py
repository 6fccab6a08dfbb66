"""DeepSeek-V3 and DeepSeek-V2 (V2-Lite shape) against transformers on tiny random models.

The engine runs MLA in the absorbed form (one latent per token in the cache, queries
projected into it; see plugins/models/deepseek.py) while transformers expands the latent
into per-head keys and values: equal tokens and logprobs within rounding show the two
agree, through plain runs, chunked prefill, prefix caching and preemption, on TORCH (the
CPU default for MLA) and TRITON interpreted. The models exercise every routing path:
V3's grouped sigmoid routing with a correction bias, V2's greedy and group-limited softmax
routing, shared experts, dense first layers, q LoRA and its absence, interleaved and
half-split rope, and YaRN with its mscale.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TEST_DEVICE, save_tokenizer
from pagedllm import SamplingParams
from tests.test_llm import NUM_TOKENS, assert_parity, hf_greedy, make_prompts, new_llm, run_engine

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32,
            v_head_dim=32, max_position_embeddings=512, initializer_range=0.3, bos_token_id=0, eos_token_id=1,
            pad_token_id=1)
MODELS = {
    # DeepSeek-V3 / R1 layout: q LoRA, grouped sigmoid routing with the correction bias
    "v3": ("V3", dict(n_group=2, topk_group=1, routed_scaling_factor=2.5)),
    # MLA alone: every layer dense; Llama-style (half-split) rope pairs
    "v3-dense-halves-rope": ("V3", dict(first_k_dense_replace=3, rope_interleave=False)),
    # YaRN: scaled frequencies, cos/sin attention factor mscale / mscale_all_dim, softmax
    # scale times mscale(mscale_all_dim)^2
    "v3-yarn": ("V3", dict(n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, beta_fast=32,
        beta_slow=1, mscale=1.0, mscale_all_dim=0.8))),
    # V2-Lite shape: no q LoRA, greedy softmax top-k, two shared experts
    "v2-lite": ("V2", dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2)),
    # V2 shape: q LoRA, group-limited greedy routing, scaled routing weights
    "v2-grouped": ("V2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=3.0)),
}
# transformers' greedy loop is the slow part of these tests: every test reuses these prompts
# (or a subset: references are cached per prompt), plus one set with a shared prefix
PROMPTS = make_prompts()
PREFIX_PROMPTS = make_prompts(seed=1, lens=[5, 20, 33, 2], shared_prefix=70)
LATENT = BASE["kv_lora_rank"] + BASE["qk_rope_head_dim"]
BYTES_PER_TOKEN = BASE["num_hidden_layers"] * LATENT * 4  # float32: one latent per token and layer


def build_deepseek(path, version: str, seed: int = 0, **overrides):
    """A random DeepSeek saved as config + safetensors + tokenizer. RMSNorm weights and the
    routing bias are randomized too (transformers initializes them to ones and zeros, which
    would hide a norm applied to the wrong tensor or a bias left out)."""
    import transformers

    config_cls = getattr(transformers, f"Deepseek{version}Config")
    model_cls = getattr(transformers, f"Deepseek{version}ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.3 * torch.randn_like(tensor))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.2 * torch.randn_like(tensor))
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cache = {}

    def make(name: str):
        if name not in cache:
            version, overrides = MODELS[name]
            cache[name] = build_deepseek(tmp_path_factory.mktemp(f"deepseek-{name}"), version, **overrides)
        return cache[name]

    return make


_REF: dict = {}


def reference(model_dir, prompts, num_tokens: int = NUM_TOKENS):
    """transformers' greedy tokens and logprob rows, cached per (model, prompt)."""
    todo = [p for p in prompts if (str(model_dir), tuple(p)) not in _REF]
    for p, result in zip(todo, hf_greedy(model_dir, todo) if todo else []):
        assert len(set(result[0])) > 4, "degenerate random model: parity would prove little"
        _REF[str(model_dir), tuple(p)] = result
    return [(tokens[:num_tokens], rows[:num_tokens])
            for tokens, rows in (_REF[str(model_dir), tuple(p)] for p in prompts)]


def max_logprob_error(outputs, ref) -> float:
    return max(abs(lp.logprob - row[token].item())
               for out, (_, rows) in zip(outputs, ref)
               for record, row in zip(out.outputs[0].logprobs, rows) for token, lp in record.items())


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_parity(model_dir, name):
    path = model_dir(name)
    prompts = PROMPTS if name in ("v3", "v2-lite") else PROMPTS[:4]  # the variants: fewer
    llm = new_llm(path)
    expected = "TORCH" if TEST_DEVICE == "cpu" else "TRITON"
    assert llm.engine.worker.backend.name == expected, f"auto-selection on {TEST_DEVICE} must pick {expected} for MLA"
    outputs = run_engine(llm, prompts)
    ref = reference(path, prompts)
    assert_parity(outputs, ref)
    # absorbed and expanded MLA agree to float32 rounding, far inside the parity tolerance
    assert max_logprob_error(outputs, ref) < 1e-4


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_chunked_prefill_parity(model_dir, name):
    path = model_dir(name)
    prompts = PROMPTS
    llm = new_llm(path, max_num_batched_tokens=16)
    outputs = run_engine(llm, prompts)
    assert_parity(outputs, reference(path, prompts))
    assert llm.engine.stats.num_steps > NUM_TOKENS + sum(len(p) for p in prompts) // 16 - 1


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_prefix_caching_parity(model_dir, name):
    path = model_dir(name)
    prompts = PREFIX_PROMPTS
    llm = new_llm(path)
    first = run_engine(llm, prompts[:1])
    rest = run_engine(llm, prompts[1:])
    assert_parity(first + rest, reference(path, prompts))
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 64 for o in rest), [o.num_cached_tokens for o in rest]


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_preemption_parity(model_dir, name):
    path = model_dir(name)
    prompts = PROMPTS
    llm = new_llm(path, kv_cache_memory=12 * 16 * BYTES_PER_TOKEN, max_model_len=160)
    outputs = run_engine(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_parity(outputs, reference(path, prompts))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_triton_interpreted_parity(model_dir, name):
    """TRITON's MLA kernels in the engine (interpreted: three prompts, 12 tokens each), a
    decode batch and prefill chunks after cached context included."""
    path = model_dir(name)
    prompts, num_tokens = PROMPTS[:3], 12
    llm = new_llm(path, attention_backend="TRITON", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_parity(outputs, reference(path, prompts, num_tokens))


def test_eager_and_default_runs_agree(model_dir):
    """No graph runner serves an MLA backend here (CPU step replay needs CPU_ATTN, which has
    no MLA kernel): the default run is eager too, and both match transformers."""
    path = model_dir("v3")
    prompts = PROMPTS[:4]
    default = new_llm(path)
    assert default.engine.worker.graph_runner is None
    eager = new_llm(path, enforce_eager=True)
    ref = reference(path, prompts)
    assert_parity(run_engine(default, prompts), ref)
    assert_parity(run_engine(eager, prompts), ref)


def test_cpu_attn_refuses_mla(model_dir):
    with pytest.raises(ValueError, match=r"CPU_ATTN cannot run here: it does not serve MLA attention "
                                         r"\(backends that do: TORCH, TRITON\)"):
        new_llm(model_dir("v3"), attention_backend="CPU_ATTN")


@pytest.mark.parametrize("kv_cache_dtype, element", [("auto", 4), ("fp8", 1)])
def test_memory_plan_counts_one_latent_per_token(model_dir, kv_cache_dtype, element):
    llm = new_llm(model_dir("v2-lite"), kv_cache_dtype=kv_cache_dtype)
    worker = llm.engine.worker
    assert worker.budget.bytes_per_token == BASE["num_hidden_layers"] * LATENT * element
    assert len(worker.kv_caches) == BASE["num_hidden_layers"]
    assert all(c.shape == (worker.budget.num_blocks, 16, LATENT) for c in worker.kv_caches)


def test_multi_token_prediction_layers_are_skipped(model_dir, tmp_path):
    """V3 checkpoints append their MTP module as layer num_hidden_layers: not served, not an error."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "with-mtp"
    shutil.copytree(model_dir("v3"), path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(256, 32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    prompts = PROMPTS[:1]
    assert_parity(run_engine(new_llm(path), prompts), reference(model_dir("v3"), prompts))
