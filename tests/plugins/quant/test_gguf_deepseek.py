"""GGUF `deepseek2` files (DeepSeek-V2 / V2-Lite / V3 / R1) against transformers.

Tiny random DeepSeek models (test_deepseek.py's builder and configs) are written to GGUF
the way llama.cpp's converter and quantizer do: experts stacked per projection, the
selection bias as `exp_probs_b.bias`, and the attention in either of llama.cpp's two
layouts: "mla" (llama.cpp since April 2025: kv_b_proj split into attn_k_b, each head's
key part transposed, and attn_v_b; the latent described as an MQA head, per-head sizes
under key_length_mla / value_length_mla) or "legacy" (attn_kv_b as is, per-head sizes
under key_length / value_length). pagedllm reads the file back: config fields and (F32)
weights equal the Hugging Face ones, and greedy tokens equal transformers' (on the
dequantized weights for Q8_0 files) through plain, chunked-prefill, prefix-caching and
preemption runs. MLA runs on TORCH here (CPU_ATTN does not serve it, and says so).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm.plugins.quant.gguf import GGUFFormat  # noqa: E402
from pagedllm.plugins.quant.gguf_deepseek import join_kv_b  # noqa: E402
from tests.plugins.models.test_deepseek import BASE, MODELS as DEEPSEEK_MODELS, build_deepseek  # noqa: E402
from tests._models import dequantized_reference, reference as shared_reference  # noqa: E402
from tests.test_llm import NUM_TOKENS, PROMPT_LENS, assert_parity, make_prompts, new_llm, run_engine  # noqa: E402,E501

T = gguf.GGMLQuantizationType
MODELS = {
    "v3": DEEPSEEK_MODELS["v3"],  # q LoRA, grouped sigmoid routing with the selection bias, scaled weights
    "v2-lite": DEEPSEEK_MODELS["v2-lite"],  # no q LoRA, greedy softmax routing, two shared experts
    "v2-grouped": DEEPSEEK_MODELS["v2-grouped"],  # group-limited greedy (expert_group_count in the file)
    # YaRN as llama.cpp can store it: mscale equal to mscale_all_dim (yarn_log_multiplier = 0.1 x it)
    "v3-yarn": ("V3", dict(n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, beta_fast=32,
        beta_slow=1, mscale=0.8, mscale_all_dim=0.8))),
}
PROMPTS = make_prompts()
PREFIX_PROMPTS = make_prompts(seed=1, lens=[5, 20, 33, 2], shared_prefix=70)
BYTES_PER_TOKEN = BASE["num_hidden_layers"] * (BASE["kv_lora_rank"] + BASE["qk_rope_head_dim"]) * 4


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Small CPU matmuls on shared cores: one OpenMP thread (see test_gguf_model.py)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------- writing the files

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
          "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
          "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
          "mlp.shared_experts.down_proj": "ffn_down_shexp"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_BIAS = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias")


def _gguf_name(name: str) -> str:
    base, kind = name.rsplit(".", 1)
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    _, _, layer, part = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[part]}.{kind}"


def _encode(x: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray, int]:
    """(what the file stores, what it dequantizes to, the type written). Rows whose length
    is not a multiple of the block size fall back to F16, as llama.cpp's quantizer does."""
    if qtype == T.F32:
        return x, x, T.F32
    if x.shape[-1] % 32:
        qtype = T.F16
        data = x.astype(np.float16)
        return data, data.astype(np.float32), T.F16
    q = gguf.quants.quantize(x, qtype)
    return q, gguf.quants.dequantize(q, qtype).reshape(x.shape), qtype


def write_deepseek_gguf(hf_dir: Path, path: Path, quant: str = "f32", layout: str = "mla",
                        groups_in_file: bool = True, gating: int | None = None) -> dict[str, torch.Tensor]:
    """Convert a tiny HF DeepSeek as llama.cpp's DeepseekV2Model would (no tokenizer);
    returns the file's weights dequantized, under the HF checkpoint's names. `gating`
    overrides the expert_gating_func written."""
    from safetensors.torch import load_file

    qtype = {"f32": T.F32, "q8_0": T.Q8_0}[quant]
    cfg = json.loads((hf_dir / "config.json").read_text())
    v3 = cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    heads, nope, rope, v = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                             "v_head_dim"))
    lora = cfg["kv_lora_rank"]
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(lora)
    if layout == "mla":  # the latent as one MQA head; the per-head sizes under *_mla
        writer.add_head_count_kv(1)
        writer.add_key_length(lora + rope)
        writer.add_value_length(lora)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    else:
        writer.add_head_count_kv(cfg["num_key_value_heads"])
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    writer.add_rope_dimension_count(rope)
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    if cfg.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if gating is None and (v3 or layout == "mla"):  # the oldest V2 files predate the key (softmax then)
        gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
    if gating is not None:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    if groups_in_file and cfg.get("n_group"):
        writer.add_expert_group_count(cfg["n_group"])
        writer.add_expert_group_used_count(cfg["topk_group"])
    scaling = cfg["rope_parameters"]
    if scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])

    state = load_file(str(hf_dir / "model.safetensors"))
    dequantized: dict[str, torch.Tensor] = {}

    def add(gname: str, x: np.ndarray, quantize: bool) -> np.ndarray:
        data, back, written = _encode(x, qtype if quantize else T.F32)
        writer.add_tensor(gname, data, raw_dtype=None if written == T.F32 else written)
        return back

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        x = tensor.float().numpy()
        if m := _EXPERT.fullmatch(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = x
            continue
        if m := _BIAS.fullmatch(name):
            dequantized[name] = torch.from_numpy(add(f"blk.{m[1]}.exp_probs_b.bias", x, False).copy())
            continue
        gname = _gguf_name(name)
        quantize = name.endswith(("proj.weight", "proj_with_mqa.weight"))  # norms, router, bias: F32
        if layout == "mla" and name.endswith("kv_b_proj.weight"):  # llama.cpp's split, k_b transposed per head
            kv_b = x.reshape(heads, nope + v, lora)
            k_b = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))  # [H, L, nope]
            v_b = np.ascontiguousarray(kv_b[:, nope:])  # [H, v, L]
            k_back = add(gname.replace("attn_kv_b", "attn_k_b"), k_b, quantize)
            v_back = add(gname.replace("attn_kv_b", "attn_v_b"), v_b, quantize)
            joined = np.concatenate([k_back.transpose(0, 2, 1), v_back], axis=1).reshape(x.shape)
            dequantized[name] = torch.from_numpy(joined.copy())
            continue
        dequantized[name] = torch.from_numpy(add(gname, x, quantize).reshape(tensor.shape).copy())
    for (layer, proj), per_expert in sorted(experts.items()):
        stacked = np.stack([per_expert[e] for e in range(len(per_expert))])  # [E, rows, cols]
        back = add(f"blk.{layer}.ffn_{proj}_exps.weight", stacked, True)
        for e in range(back.shape[0]):
            dequantized[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = torch.from_numpy(back[e].copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


_CASES: dict = {}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """case(model, quant, layout) -> (gguf path, HF dir holding the file's (dequantized) weights)."""

    def make(name: str, quant: str = "f32", layout: str = "mla"):
        key = (name, quant, layout)
        if key not in _CASES:
            if (name, "hf") not in _CASES:
                version, overrides = MODELS[name]
                _CASES[name, "hf"] = build_deepseek(tmp_path_factory.mktemp(f"ds-{name}-hf"), version, **overrides)
            hf_dir = _CASES[name, "hf"]
            root = tmp_path_factory.mktemp(f"ds-{name}-{quant}-{layout}")
            weights = write_deepseek_gguf(hf_dir, root / "model.gguf", quant, layout)
            # transformers runs what the file dequantizes to
            ref = hf_dir if quant == "f32" else dequantized_reference(hf_dir, root, weights)
            _CASES[key] = (root / "model.gguf", ref)
        return _CASES[key]

    return make


def reference(path, prompts):
    return shared_reference(path, prompts, varied=True)


def gguf_llm(path: Path, ref: Path, **kwargs):
    return new_llm(path, tokenizer=str(ref), **kwargs)


# --------------------------------------------------------------------------- config and weights

_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
           "max_position_embeddings", "tie_word_embeddings", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
           "qk_nope_head_dim", "qk_head_dim", "v_head_dim", "head_dim", "first_k_dense_replace",
           "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
           "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group"]


@pytest.mark.parametrize("layout", ["mla", "legacy"])
@pytest.mark.parametrize("name", list(MODELS))
def test_config_fields_equal_the_hf_config(case, name, layout):
    from transformers import AutoConfig

    path, _ = case(name, "f32", layout)
    ours, theirs = GGUFFormat(str(path)).hf_config(), AutoConfig.from_pretrained(_CASES[name, "hf"])
    assert type(ours) is type(theirs) and ours.architectures == theirs.architectures
    for field in _FIELDS + (["topk_method"] if MODELS[name][0] == "V2" else ["rope_interleave"]):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # stored as float32
    ours_rope, theirs_rope = dict(ours.rope_parameters), dict(theirs.rope_parameters)
    assert set(ours_rope) == set(theirs_rope)
    for key, value in theirs_rope.items():  # yarn's mscale went through a float32 x 0.1
        assert ours_rope[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key


def test_v3_without_group_keys_routes_over_one_group(case, tmp_path):
    """A file without expert_group_count (llama.cpp runs it ungrouped): one group, all kept."""
    case("v3")
    path = tmp_path / "ungrouped.gguf"
    write_deepseek_gguf(_CASES["v3", "hf"], path, groups_in_file=False)
    cfg = GGUFFormat(str(path)).hf_config()
    assert (cfg.n_group, cfg.topk_group) == (1, 1)


@pytest.mark.parametrize("layout", ["mla", "legacy"])
@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_f32_weights_are_the_hf_ones(case, name, layout):
    """Every tensor is the checkpoint's under its HF name: experts stacked [E, rows, cols],
    the selection bias as mlp.gate.e_score_correction_bias, and kv_b_proj exactly
    rebuilt from llama.cpp's split k_b / v_b."""
    from safetensors.torch import load_file

    path, hf_dir = case(name, "f32", layout)
    state = load_file(str(hf_dir / "model.safetensors"))
    loaded = dict(GGUFFormat(str(path)).weights())
    num_experts = BASE["n_routed_experts"]
    for layer in range(BASE["first_k_dense_replace"], BASE["num_hidden_layers"]):
        for proj in ("gate", "up", "down"):
            stacked = loaded.pop(f"model.layers.{layer}.mlp.experts.{proj}_proj.weight")
            expected = torch.stack([state.pop(f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight")
                                    for e in range(num_experts)])
            assert torch.equal(stacked, expected)
    assert set(loaded) == set(state)
    for key, tensor in loaded.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, state[key]), key
    assert ("model.layers.1.mlp.gate.e_score_correction_bias" in loaded) == (name == "v3")


def test_join_kv_b_inverts_llama_cpp_split():
    """Non-square per-head blocks (nope != v != L), so a missing transpose or a swapped
    key/value order cannot pass."""
    heads, nope, v, lora = 3, 5, 7, 11
    kv_b = torch.randn(heads * (nope + v), lora)
    per_head = kv_b.view(heads, nope + v, lora)
    k_b = per_head[:, :nope].transpose(1, 2).contiguous()  # llama.cpp's attn_k_b [H, L, nope]
    v_b = per_head[:, nope:].contiguous()  # attn_v_b [H, v, L]
    assert torch.equal(join_kv_b(k_b, v_b), kv_b)
    with pytest.raises(ValueError, match="do not split one kv_b_proj"):
        join_kv_b(k_b.transpose(1, 2), v_b)


def test_quantized_projections_arrive_as_tagged_blocks(case):
    """Q8_0 file: the MLA projections stay blocks (kv_b in the legacy layout too); k_b / v_b
    are dequantized and joined, q_b_proj (48 columns, not a block multiple) is F16."""
    for layout in ("mla", "legacy"):
        path, _ = case("v3", "q8_0", layout)
        loaded = dict(GGUFFormat(str(path)).weights())
        attn = "model.layers.0.self_attn"
        for proj in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
            assert loaded[f"{attn}.{proj}.weight"].gguf_qtype == T.Q8_0, proj
        kv_b = loaded[f"{attn}.kv_b_proj.weight"]
        if layout == "legacy":
            assert kv_b.gguf_qtype == T.Q8_0 and kv_b.dtype == torch.uint8
        else:
            assert kv_b.dtype == torch.float32 and kv_b.shape == (4 * (32 + 32), 32)
        assert loaded[f"{attn}.q_b_proj.weight"].dtype == torch.float32
        assert loaded["model.layers.1.mlp.experts.gate_proj.weight"].gguf_qtype == T.Q8_0


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("name, quant, layout", [
    ("v3", "f32", "mla"), ("v3", "f32", "legacy"), ("v3", "q8_0", "mla"), ("v3", "q8_0", "legacy"),
    ("v2-lite", "f32", "mla"), ("v2-lite", "f32", "legacy"), ("v2-lite", "q8_0", "mla"),
])
def test_greedy_parity(case, name, quant, layout):
    path, ref = case(name, quant, layout)
    llm = gguf_llm(path, ref)
    assert llm.engine.worker.backend.name == "TORCH"
    assert type(llm.engine.worker.model).__name__ == f"Deepseek{MODELS[name][0]}ForCausalLM"
    assert_parity(run_engine(llm, PROMPTS), reference(ref, PROMPTS))


@pytest.mark.parametrize("name", ["v3-yarn", "v2-grouped"])
def test_variant_parity(case, name):
    """YaRN from llama.cpp's keys (scaled frequencies, mscale from yarn_log_multiplier) and
    V2's group-limited routing from expert_group_count."""
    path, ref = case(name)
    prompts = PROMPTS[:4]
    assert_parity(run_engine(gguf_llm(path, ref), prompts), reference(ref, prompts))


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_keep_quantized_parity(case, name):
    """Experts and projections kept as Q8_0 blocks (no dense copy)."""
    path, ref = case(name, "q8_0")
    llm = gguf_llm(path, ref, plugin_options={"gguf_keep_quantized": True})
    experts = llm.engine.worker.model.model.layers[1].mlp.experts
    assert not hasattr(experts, "w13_weight") and experts.gguf_expert_parts["w13"][0].qtype == T.Q8_0
    assert_parity(run_engine(llm, PROMPTS), reference(ref, PROMPTS))


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_chunked_prefill_parity(case, name):
    path, ref = case(name, "q8_0")
    llm = gguf_llm(path, ref, max_num_batched_tokens=16)
    assert_parity(run_engine(llm, PROMPTS), reference(ref, PROMPTS))
    assert llm.engine.stats.num_steps > NUM_TOKENS + sum(PROMPT_LENS) // 16 - 1


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_prefix_caching_parity(case, name):
    path, ref = case(name, "q8_0")
    llm = gguf_llm(path, ref)
    first = run_engine(llm, PREFIX_PROMPTS[:1])
    rest = run_engine(llm, PREFIX_PROMPTS[1:])
    assert_parity(first + rest, reference(ref, PREFIX_PROMPTS))
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 64 for o in rest), [o.num_cached_tokens for o in rest]


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_preemption_parity(case, name):
    path, ref = case(name, "q8_0")
    llm = gguf_llm(path, ref, kv_cache_memory=12 * 16 * BYTES_PER_TOKEN, max_model_len=160)
    outputs = run_engine(llm, PROMPTS)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_parity(outputs, reference(ref, PROMPTS))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


# --------------------------------------------------------------------------- errors


def test_cpu_attn_refuses_the_latent_cache(case):
    path, ref = case("v2-lite")
    with pytest.raises(ValueError, match=r"CPU_ATTN cannot run here: it does not serve MLA attention"):
        gguf_llm(path, ref, attention_backend="CPU_ATTN")


def test_softmax_routing_with_a_selection_bias_is_refused(case, tmp_path):
    case("v3")
    path = tmp_path / "softmax-bias.gguf"
    write_deepseek_gguf(_CASES["v3", "hf"], path, gating=gguf.ExpertGatingFuncType.SOFTMAX)
    with pytest.raises(NotImplementedError, match="softmax routing and a selection bias"):
        GGUFFormat(str(path)).hf_config()
