"""Gemma 3 (text) and Gemma 2 against transformers on tiny random models.

The models mix sliding-window and global layers with a window (8) shorter than most
prompts, scale queries by query_pre_attn_scalar != head_dim, give the two layer kinds
their own RoPE (linear scaling on the global one), and soft-cap final logits at a value
the random logits exceed; norm weights are random (transformers initialises them to zero,
which would hide a wrong (1 + w)). Greedy tokens must equal transformers' (eager
attention, float32) and logprobs stay within 2e-3 through plain runs, chunked prefill,
prefix caching and preemption, on TORCH and CPU_ATTN (TRITON instead on a GPU), and on TRITON (interpreted) briefly.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import NATIVE_BACKEND, TEST_DEVICE, save_tokenizer
from tests.test_llm import assert_parity, make_prompts, new_llm, run_engine

NUM_TOKENS = 32  # what tests.test_llm.run_engine generates
PROMPT_LENS = [3, 17, 40, 1, 25]
BACKENDS = ["TORCH", NATIVE_BACKEND]
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
FINAL_CAP = 8.0  # below the random models' largest logits (about 10), so the cap binds
ATTN_CAP = 5.0

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
              pad_token_id=1, sliding_window=8, query_pre_attn_scalar=24)
VARIANTS = {
    # attn_logit_softcapping is set but transformers' Gemma 3 ignores it: so must we
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        initializer_range=0.3, tie_word_embeddings=False, layer_types=LAYER_TYPES,
        final_logit_softcapping=FINAL_CAP, attn_logit_softcapping=ATTN_CAP,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})),
    # Gemma's default tied head; with a tied head a large init makes the model echo its input
    "gemma3-tied": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        initializer_range=0.05, tie_word_embeddings=True, layer_types=LAYER_TYPES)),
    # default layer_types: alternating sliding / global
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        initializer_range=0.3, tie_word_embeddings=False, final_logit_softcapping=FINAL_CAP,
        attn_logit_softcapping=ATTN_CAP)),
}


def build_gemma(path: Path, variant: str, seed: int = 0, **overrides) -> Path:
    import transformers

    cls, config_cls, settings = VARIANTS[variant]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **settings, **overrides})
    model = getattr(transformers, cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = build_gemma(tmp_path_factory.mktemp(variant), variant)
        return cache[variant]

    return make


def load_hf(model_dir: Path, **config_overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                **config_overrides).eval()


_REFERENCE: dict = {}


def reference(model_dir: Path, prompts: list[list[int]], num_tokens: int = NUM_TOKENS):
    """(tokens, log-softmax rows) per prompt from transformers' eager attention: a plain
    argmax loop over the KV-cached forward (as tests.test_llm.hf_greedy, which loads the
    default attention implementation)."""
    key = (str(model_dir), tuple(map(tuple, prompts)), num_tokens)
    if key in _REFERENCE:
        return _REFERENCE[key]
    model = load_hf(model_dir)
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            tokens, rows = [], []
            for _ in range(num_tokens):
                row = torch.log_softmax(out.logits[0, -1].float(), -1)
                tokens.append(int(row.argmax()))
                rows.append(row)
                out = model(torch.tensor([[tokens[-1]]]), use_cache=True, **{cache_name: getattr(out, cache_name)})
            results.append((tokens, rows))
    _REFERENCE[key] = results
    return results


# --------------------------------------------------------------------------- guards on the test models


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_reference_outputs_are_not_degenerate(gemma_dir, variant):
    ref = reference(gemma_dir(variant), make_prompts(lens=PROMPT_LENS))
    assert all(len(set(tokens)) > 4 for tokens, _ in ref), [len(set(t)) for t, _ in ref]


@pytest.mark.parametrize("variant, override", [("gemma3", "final_logit_softcapping"),
                                               ("gemma2", "final_logit_softcapping"),
                                               ("gemma2", "attn_logit_softcapping"),
                                               ("gemma3", "sliding_window")])
def test_each_feature_changes_the_reference(gemma_dir, variant, override):
    """The parity tests prove a feature only if transformers' output depends on it here:
    dropping the soft-caps, or widening the window past the prompt, must move the logits."""
    model_dir = gemma_dir(variant)
    ids = torch.tensor([make_prompts(lens=[40])[0]])
    value = 1000 if override == "sliding_window" else None
    with torch.no_grad():
        base = load_hf(model_dir)(ids).logits
        changed = load_hf(model_dir, **{override: value})(ids).logits
    assert (base - changed).abs().max() > 0.05


# --------------------------------------------------------------------------- engine parity


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_parity(gemma_dir, variant, backend):
    model_dir = gemma_dir(variant)
    prompts = make_prompts(lens=PROMPT_LENS)
    llm = new_llm(model_dir, attention_backend=backend)
    assert llm.engine.worker.backend.name == backend
    assert_parity(run_engine(llm, prompts), reference(model_dir, prompts))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["gemma3", "gemma2"])
def test_chunked_prefill_parity(gemma_dir, variant, backend):
    model_dir = gemma_dir(variant)
    prompts = make_prompts(lens=PROMPT_LENS)
    llm = new_llm(model_dir, attention_backend=backend, max_num_batched_tokens=16)
    assert_parity(run_engine(llm, prompts), reference(model_dir, prompts))
    assert llm.engine.stats.num_steps > NUM_TOKENS + sum(PROMPT_LENS) // 16 - 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_caching_parity(gemma_dir, backend):
    model_dir = gemma_dir("gemma3")
    prompts = make_prompts(seed=1, lens=[5, 20, 3], shared_prefix=40)
    llm = new_llm(model_dir, attention_backend=backend)
    first = run_engine(llm, prompts[:1])
    rest = run_engine(llm, prompts[1:])
    assert_parity(first + rest, reference(model_dir, prompts))
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 32 for o in rest), [o.num_cached_tokens for o in rest]


@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_parity(gemma_dir, backend):
    model_dir = gemma_dir("gemma3")
    prompts = make_prompts(seed=2, lens=[40, 30, 50, 20, 60, 25])
    # 4 layers x 2 kv heads x 32 dims x 4 bytes x 2 = 2048 bytes/token; 12 blocks of 16 tokens
    llm = new_llm(model_dir, attention_backend=backend, kv_cache_memory=12 * 16 * 2048, max_model_len=160)
    outputs = run_engine(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_parity(outputs, reference(model_dir, prompts))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("variant", ["gemma3", "gemma2"])
def test_triton_parity(gemma_dir, variant):
    """Interpreted Triton is slow: two prompts (one past the window), a few tokens."""
    pytest.importorskip("triton")
    from pagedllm import SamplingParams

    model_dir = gemma_dir(variant)
    prompts = make_prompts(seed=3, lens=[12, 4])
    llm = new_llm(model_dir, attention_backend="TRITON", kv_cache_memory=1 << 22)
    assert llm.engine.worker.backend.name == "TRITON"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_parity(outputs, reference(model_dir, prompts, num_tokens=4))


# --------------------------------------------------------------------------- config reading


def test_kv_cache_spec_windows_follow_layer_types():
    from transformers import Gemma2Config, Gemma3TextConfig

    from pagedllm.plugins.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM

    spec = Gemma3ForCausalLM.kv_cache_spec(Gemma3TextConfig(**COMMON, layer_types=LAYER_TYPES))
    assert spec.sliding_windows == (8, 8, None, 8) and spec.kv_window is None
    assert (spec.num_heads, spec.num_kv_heads, spec.head_size) == (4, 2, 32)
    # the older sliding_window_pattern field: every 2nd layer global
    spec = Gemma3ForCausalLM.kv_cache_spec(Gemma3TextConfig(**COMMON, sliding_window_pattern=2))
    assert spec.sliding_windows == (8, None, 8, None)
    assert Gemma2ForCausalLM.kv_cache_spec(Gemma2Config(**COMMON)).sliding_windows == (8, None, 8, None)
    # a config object without layer_types (e.g. built by hand) derives them from the pattern
    plain = SimpleNamespace(**COMMON, sliding_window_pattern=3)
    assert Gemma3ForCausalLM.kv_cache_spec(plain).sliding_windows == (8, 8, None, 8)


def test_rope_per_layer_type_from_old_and_new_fields():
    from transformers import Gemma2Config, Gemma3TextConfig

    from pagedllm.plugins.models.gemma import rope_by_layer_type

    new = rope_by_layer_type(Gemma3TextConfig(**COMMON, rope_parameters=VARIANTS["gemma3"][2]["rope_parameters"]))
    assert new["sliding_attention"] == (10000.0, {"rope_type": "default"})
    assert new["full_attention"] == (1e6, {"rope_type": "linear", "factor": 2.0})
    # the fields older config.json files carry (transformers converts them on load)
    old = rope_by_layer_type(Gemma3TextConfig(**COMMON, rope_theta=5e5, rope_local_base_freq=2e4,
                                              rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert old["sliding_attention"][0] == 2e4 and old["sliding_attention"][1].get("rope_type") == "default"
    assert old["full_attention"][0] == 5e5 and old["full_attention"][1]["factor"] == 8.0
    # a flat namespace (no rope_parameters) and Gemma 2's single set
    flat = rope_by_layer_type(SimpleNamespace(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None))
    assert flat == {"full_attention": (1e6, {}), "sliding_attention": (1e4, {})}
    g2 = rope_by_layer_type(Gemma2Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 3e4}))
    assert g2["full_attention"] == g2["sliding_attention"]
    assert g2["full_attention"][0] == 3e4 and g2["full_attention"][1]["rope_type"] == "default"


def test_gelu_and_mul_matches_transformers_activation():
    from transformers.activations import ACT2FN

    from pagedllm import ops

    x = torch.randn(5, 2 * 24)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.gelu_and_mul(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)


def test_unsupported_settings_are_refused(gemma_dir, tmp_path):
    import json
    import shutil

    src = gemma_dir("gemma3-tied")
    for key, value, words in [("use_bidirectional_attention", True, "bidirectional"),
                              ("hidden_activation", "relu", "hidden_activation")]:
        model_dir = tmp_path / key
        shutil.copytree(src, model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg[key] = value
        (model_dir / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(NotImplementedError, match=words):
            new_llm(model_dir)


# --------------------------------------------------------------------------- GGUF (llama.cpp's layout)

_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def write_gemma_gguf(hf_dir: Path, path: Path, arch: str, window_pattern) -> Path:
    """Convert a tiny Gemma directory as llama.cpp's convert_hf_to_gguf does: its tensor
    names, norm weights stored with the 1 of (1 + w) added, the metadata keys it writes
    (no tokenizer: the tests pass the directory's)."""
    import json

    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_sliding_window(cfg["sliding_window"])
    if window_pattern is not None:
        writer.add_sliding_window_pattern(window_pattern)
    rope = cfg["rope_parameters"]
    if arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if rope["full_attention"].get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            getattr(writer, f"add_{key}")(cfg[key])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        x = tensor.float().numpy()
        if name.endswith("norm.weight"):
            x = x + 1
        if name in _GGUF_GLOBAL:
            writer.add_tensor(_GGUF_GLOBAL[name], x)
            continue
        _, _, layer, rest = name.split(".", 3)
        part, kind = rest.rsplit(".", 1)
        writer.add_tensor(f"blk.{layer}.{_GGUF_LAYER[part]}.{kind}", x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# transformers' query_pre_attn_scalar is not in a GGUF file: llama.cpp takes head_dim (hidden /
# heads for the 27B models), so the GGUF test models use head_dim
GGUF_CASES = {
    # gemma3's layer mix as a per-layer flag array; gemma2 with the default pattern (2)
    "gemma3": ("gemma3", [t == "sliding_attention" for t in LAYER_TYPES]),
    "gemma2": ("gemma2", None),
}


@pytest.mark.parametrize("variant", sorted(GGUF_CASES))
def test_gguf_matches_transformers(tmp_path, variant):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from pagedllm import LLM
    from pagedllm.plugins.quant.gguf import GGUFFormat

    arch, pattern = GGUF_CASES[variant]
    hf_dir = build_gemma(tmp_path / "hf", variant, query_pre_attn_scalar=COMMON["head_dim"])
    path = write_gemma_gguf(hf_dir, tmp_path / "tiny.gguf", arch, pattern)

    fmt = GGUFFormat(str(path))
    got_cfg, want_cfg = fmt.hf_config(), AutoConfig.from_pretrained(hf_dir)
    assert type(got_cfg) is type(want_cfg)
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "final_logit_softcapping",
                "attn_logit_softcapping", "rope_parameters", "head_dim"):
        assert getattr(got_cfg, key) == getattr(want_cfg, key), key
    state = load_file(str(hf_dir / "model.safetensors"))
    loaded = dict(fmt.weights())
    assert set(loaded) == set(state)
    for name, tensor in loaded.items():  # norms come back from (1 + w) to w
        torch.testing.assert_close(tensor, state[name].float(), atol=1e-6, rtol=0, msg=name)

    prompts = make_prompts(seed=4, lens=[3, 17, 40])
    llm = LLM(str(path), tokenizer=str(hf_dir), kv_cache_memory=1 << 24, dtype="float32", device=TEST_DEVICE)
    assert_parity(run_engine(llm, prompts), reference(hf_dir, prompts))
