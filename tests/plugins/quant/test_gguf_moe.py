"""GGUF Qwen3-MoE (qwen3moe) and Qwen2-MoE (qwen2moe) files against transformers.

Tiny random Hugging Face MoE models are written to GGUF the way llama.cpp's converter
and quantizer do (experts stacked per projection, router and shared-expert gate in F32,
the gate 1-D), then run by pagedllm and compared with transformers on the same weights:
the original ones for F32 files, the dequantized ones for quantized files. Greedy tokens
must be equal and logprobs close, through plain, chunked-prefill, prefix-caching and
preemption runs on the TORCH and CPU_ATTN backends, with experts dequantized at load
(default) and kept as blocks (`gguf_keep_quantized`: the native kernel for Q8_0, a
per-call dequantization for Q5_0, both in one layer for mixed types).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm.plugins.models.qwen_moe import is_sparse_layer, num_experts  # noqa: E402
from pagedllm.plugins.quant.gguf import GGUFFormat  # noqa: E402
from tests._models import dequantized_reference, held_experts, reference, save_hf_model  # noqa: E402
from tests.test_llm import (  # noqa: E402
    NUM_TOKENS,
    PROMPT_LENS,
    assert_parity,
    make_prompts,
    new_llm,
    run_engine,
)

T = gguf.GGMLQuantizationType
BACKENDS = ["TORCH", "CPU_ATTN"]
# every input size a multiple of 32 (Q8_0 / Q5_0 blocks): hidden 64, experts 32, shared 64, dense 96
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, initializer_range=0.3, bos_token_id=0, eos_token_id=1, pad_token_id=1,
            tie_word_embeddings=False)
MODELS = {
    # llama.cpp renormalizes qwen3moe's top-k probabilities (and never qwen2moe's)
    "qwen3moe": ("qwen3moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(head_dim=16, norm_topk_prob=True)),
    "qwen2moe": ("qwen2moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                 dict(shared_expert_intermediate_size=64, norm_topk_prob=False)),
    # layer 0 dense: the sparse layers come from which routers the file has
    "qwen3moe-mlp-only": ("qwen3moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                          dict(head_dim=16, norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen2moe-no-bias": ("qwen2moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                         dict(shared_expert_intermediate_size=64, qkv_bias=False)),
}
# file variants: ggml type of the experts' (gate, up, down) and of the dense projections
QUANT = {
    "f32": ((T.F32, T.F32, T.F32), T.F32),
    "q8_0": ((T.Q8_0, T.Q8_0, T.Q8_0), T.Q8_0),
    "q5_0": ((T.Q5_0, T.Q5_0, T.Q5_0), T.Q8_0),
    "q4_0": ((T.Q4_0, T.Q4_0, T.Q4_0), T.Q8_0),  # the native kernel with per-block offsets
    "mixed": ((T.Q8_0, T.Q5_0, T.Q8_0), T.Q8_0),  # gate and up of different types: two parts of w13
}
KEEP = {"gguf_keep_quantized": True}


# --------------------------------------------------------------------------- writing the files

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FLOAT_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # llama.cpp never quantizes the routers


def _gguf_name(name: str) -> str:
    base, kind = name.rsplit(".", 1)
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    _, _, layer, part = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[part]}.{kind}"


def _encode(x: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, what it dequantizes to)."""
    if qtype == T.F32:
        return x, x
    q = gguf.quants.quantize(x, qtype)
    return q, gguf.quants.dequantize(q, qtype).reshape(x.shape)


def write_moe_gguf(hf_dir: Path, path: Path, arch: str, quant: str, sizes_in_metadata: bool = True,
                   extra_kv: dict[str, float] | None = None) -> dict:
    """Convert a tiny HF MoE model as llama.cpp would (no tokenizer); returns the file's
    weights dequantized, under the HF checkpoint's names (transformers' reference)."""
    from safetensors.torch import load_file

    expert_types, linear_type = QUANT[quant]
    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if sizes_in_metadata:  # older files: the loader falls back to the tensors' shapes
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])  # transformers 5 saves the latter
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    for key, value in (extra_kv or {}).items():
        writer.add_float32(f"{arch}.{key}", value)
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    dequantized: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        x = tensor.float().numpy()
        if m := _EXPERT.fullmatch(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = x
            continue
        gname = _gguf_name(name)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            x = x.reshape(-1)  # llama.cpp's files hold the [1, H] gate as [H]
        qtype = linear_type if name.endswith("proj.weight") and not gname.endswith(_FLOAT_ALWAYS) else T.F32
        data, back = _encode(x, qtype)
        writer.add_tensor(gname, data, raw_dtype=None if qtype == T.F32 else qtype)
        dequantized[name] = torch.from_numpy(back.reshape(tensor.shape).copy())
    for (layer, proj), per_expert in sorted(experts.items()):
        stacked = np.stack([per_expert[e] for e in range(len(per_expert))])  # [E, rows, cols]
        qtype = expert_types[("gate", "up", "down").index(proj)]
        data, back = _encode(stacked, qtype)
        writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", data, raw_dtype=None if qtype == T.F32 else qtype)
        for e in range(back.shape[0]):
            dequantized[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = torch.from_numpy(back[e].copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


def _build_hf(path: Path, name: str) -> Path:
    _, cls, cfg_cls, extra = MODELS[name]
    return save_hf_model(path, cls, cfg_cls, {**TINY, **extra})


_CASES: dict = {}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """case(model, quant) -> (gguf path, HF dir with the file's (dequantized) weights)."""

    def make(name: str, quant: str = "f32"):
        key = (name, quant)
        if key not in _CASES:
            if (name, "hf") not in _CASES:
                _CASES[name, "hf"] = _build_hf(tmp_path_factory.mktemp(f"{name}-hf"), name)
            hf_dir = _CASES[name, "hf"]
            root = tmp_path_factory.mktemp(f"{name}-{quant}")
            weights = write_moe_gguf(hf_dir, root / "model.gguf", MODELS[name][0], quant)
            # transformers runs what the file dequantizes to
            ref = hf_dir if quant == "f32" else dequantized_reference(hf_dir, root, weights)
            _CASES[key] = (root / "model.gguf", ref)
        return _CASES[key]

    return make





def gguf_llm(path: Path, ref: Path, **kwargs):
    return new_llm(path, tokenizer=str(ref), **kwargs)


# --------------------------------------------------------------------------- config and weights


@pytest.mark.parametrize("sizes_in_metadata", [True, False], ids=["metadata", "tensor-shapes"])
@pytest.mark.parametrize("name", list(MODELS))
def test_config_fields_equal_the_hf_config(case, tmp_path, name, sizes_in_metadata):
    from transformers import AutoConfig

    gguf_path, _ = case(name)
    hf_dir = _CASES[name, "hf"]
    path = gguf_path
    if not sizes_in_metadata:
        path = tmp_path / "older.gguf"
        write_moe_gguf(hf_dir, path, MODELS[name][0], "f32", sizes_in_metadata=False)
    ours, theirs = GGUFFormat(str(path)).hf_config(), AutoConfig.from_pretrained(hf_dir)
    assert ours.architectures == theirs.architectures
    assert num_experts(ours) == num_experts(theirs) == TINY["num_experts"]
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # stored as float32
    fields = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "tie_word_embeddings", "vocab_size", "max_position_embeddings"]
    if MODELS[name][0] == "qwen2moe":
        fields += ["shared_expert_intermediate_size", "qkv_bias"]
    else:
        fields += ["head_dim"]
    for field in fields:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]
    layers = range(theirs.num_hidden_layers)
    assert [is_sparse_layer(ours, i) for i in layers] == [is_sparse_layer(theirs, i) for i in layers]


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_f32_weights_are_the_hf_ones_stacked(case, name):
    """The format's tensors are the checkpoint's, experts stacked [E, rows, cols] under the
    names FusedMoE maps, the shared-expert gate back to [1, H]."""
    from safetensors.torch import load_file

    path, ref = case(name)
    state = load_file(str(ref / "model.safetensors"))
    loaded = dict(GGUFFormat(str(path)).weights())
    for layer in range(2):
        for proj in ("gate", "up", "down"):
            stacked = loaded.pop(f"model.layers.{layer}.mlp.experts.{proj}_proj.weight")
            expected = torch.stack([state.pop(f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight")
                                    for e in range(TINY["num_experts"])])
            assert torch.equal(stacked, expected)
    assert set(loaded) == set(state)
    for key, tensor in loaded.items():
        assert torch.equal(tensor, state[key].float()), key


def test_quantized_experts_arrive_as_tagged_blocks(case):
    path, _ = case("qwen2moe", "mixed")
    loaded = dict(GGUFFormat(str(path)).weights())
    gate = loaded["model.layers.0.mlp.experts.gate_proj.weight"]
    up = loaded["model.layers.0.mlp.experts.up_proj.weight"]
    assert gate.dtype == up.dtype == torch.uint8
    assert (gate.gguf_qtype, up.gguf_qtype) == (T.Q8_0, T.Q5_0)
    assert gate.shape == (8, 32, 64 // 32 * 34) and up.shape == (8, 32, 64 // 32 * 22)
    router = loaded["model.layers.0.mlp.gate.weight"]
    assert router.dtype == torch.float32 and router.shape == (8, 64)
    assert loaded["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)


def test_models_are_not_degenerate(case):
    for name in ("qwen3moe", "qwen2moe"):
        _, ref = case(name)
        assert all(len(set(tokens)) > 4 for tokens, _ in reference(ref, make_prompts()))


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quant", ["f32", "q8_0"])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_parity(case, name, quant, backend):
    path, ref = case(name, quant)
    prompts = make_prompts()
    llm = gguf_llm(path, ref, attention_backend=backend)
    experts = next(m.mlp.experts for m in llm.engine.worker.model.model.layers if hasattr(m.mlp, "experts"))
    w13, _ = held_experts(experts)
    assert w13.dtype == torch.float32 and w13.shape == (8, 64, 64)
    assert_parity(run_engine(llm, prompts), reference(ref, prompts))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_0", "q5_0", "mixed"])
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_keep_quantized_parity(case, name, quant, backend):
    """Experts kept as blocks: no dense copy; Q8_0 / Q4_0 parts repacked for the native
    kernel (where it builds), Q5_0 parts dequantized per call."""
    from pagedllm.ops.cpu import native

    path, ref = case(name, quant)
    prompts = make_prompts()
    llm = gguf_llm(path, ref, attention_backend=backend, plugin_options=KEEP)
    experts = llm.engine.worker.model.model.layers[1].mlp.experts
    assert not hasattr(experts, "w13_weight") and not hasattr(experts, "w2_weight")
    gate_type, up_type = (None if t == T.F32 else t for t in QUANT[quant][0][:2])  # None: float rows
    w13 = experts.gguf_expert_parts["w13"]
    assert [p.qtype for p in w13] == ([gate_type] if gate_type == up_type else [gate_type, up_type])
    assert [p.rows for p in w13] == ([64] if gate_type == up_type else [32, 32])
    for part in w13 + experts.gguf_expert_parts["w2"]:
        assert bool(part.packed) == (part.qtype in native.SUPPORTED_QTYPES and native.available())
        assert getattr(experts, part.name).dtype == (torch.float32 if part.qtype is None else torch.uint8)
    assert_parity(run_engine(llm, prompts), reference(ref, prompts))


@pytest.mark.parametrize("keep", [False, True], ids=["dense", "keep-quantized"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_chunked_prefill_parity(case, name, backend, keep):
    path, ref = case(name, "q8_0")
    prompts = make_prompts()
    llm = gguf_llm(path, ref, attention_backend=backend, max_num_batched_tokens=16,
                   plugin_options=KEEP if keep else {})
    assert_parity(run_engine(llm, prompts), reference(ref, prompts))
    assert llm.engine.stats.num_steps > NUM_TOKENS + sum(PROMPT_LENS) // 16 - 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_prefix_caching_parity(case, name, backend):
    path, ref = case(name, "q8_0")
    prompts = make_prompts(seed=1, lens=[5, 20, 33, 2], shared_prefix=70)
    llm = gguf_llm(path, ref, attention_backend=backend)
    first = run_engine(llm, prompts[:1])
    rest = run_engine(llm, prompts[1:])
    assert_parity(first + rest, reference(ref, prompts))
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 64 for o in rest), [o.num_cached_tokens for o in rest]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_preemption_parity(case, name, backend):
    path, ref = case(name, "q8_0")
    prompts = make_prompts(seed=2)
    # 2 layers x 2 kv heads x 16 dims x 4 bytes x 2 = 512 bytes/token; 12 blocks of 16 tokens
    llm = gguf_llm(path, ref, attention_backend=backend, kv_cache_memory=12 * 16 * 512, max_model_len=160)
    outputs = run_engine(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_parity(outputs, reference(ref, prompts))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q5_0])
def test_kept_expert_rows_in_bf16(qtype):
    """A kept part multiplies bf16 activations too (the native kernel reads float32 only:
    its codes are dequantized for that call), close to the float32 product."""
    from pagedllm.plugins.quant.gguf_linear import tag_raw
    from pagedllm.plugins.quant.gguf_moe import GGUFMoEMethod, _expert_linear

    torch.manual_seed(0)
    layer = torch.nn.Module()
    layer.num_experts, layer.prefix = 3, "model.layers.0.mlp.experts"
    method = GGUFMoEMethod(keep_dense=False)
    method.create_weights(layer, 3, 64, 32, torch.bfloat16)
    weights = {}
    for name, shard, rows, cols in (("w13", 0, 32, 64), ("w13", 1, 32, 64), ("w2", None, 64, 32)):
        w = torch.randn(3, rows, cols).numpy()
        raw = gguf.quants.quantize(w, qtype)
        weights[name, shard] = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(w.shape).copy())
        getattr(layer, f"{name}_weight").weight_loader(getattr(layer, f"{name}_weight"),
                                                       tag_raw(torch.from_numpy(raw.copy()), qtype), (None, shard))
    method.process_after_loading(layer)
    x = torch.randn(5, 64)
    for e in range(3):
        expected = x @ torch.cat([weights["w13", 0][e], weights["w13", 1][e]]).T
        got32 = _expert_linear(layer.gguf_expert_parts["w13"], layer, e, x)
        got16 = _expert_linear(layer.gguf_expert_parts["w13"], layer, e, x.bfloat16())
        assert got16.dtype == torch.bfloat16
        torch.testing.assert_close(got32, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got16.float(), expected, atol=0.3, rtol=0.02)


# --------------------------------------------------------------------------- errors


def test_expert_weights_scale_is_refused(case, tmp_path):
    """llama.cpp would scale the routing weights; Qwen-MoE's block has no such factor."""
    case("qwen3moe")
    path = tmp_path / "scaled.gguf"
    write_moe_gguf(_CASES["qwen3moe", "hf"], path, "qwen3moe", "f32", extra_kv={"expert_weights_scale": 2.5})
    with pytest.raises(NotImplementedError, match="expert_weights_scale 2.5"):
        GGUFFormat(str(path)).hf_config()


def test_file_without_routers_is_refused(tiny_model_dir, tmp_path):
    """A dense model's tensors labelled qwen3moe: named, not loaded as a model without experts."""
    from tests.plugins.quant.test_gguf_model import write_gguf

    path = write_gguf(tiny_model_dir("qwen3"), tmp_path / "dense.gguf", "qwen3", arch_name="qwen3moe")
    with pytest.raises(ValueError, match="qwen3moe GGUF has no expert router"):
        GGUFFormat(str(path)).hf_config()
