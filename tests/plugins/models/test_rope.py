"""RoPE scaling against transformers: the cos/sin tables of every scaling type row by row
(transformers' own rotary module), then tiny models end to end past the original length
(yarn, dynamic NTK, longrope), the flags that add a scaling to a checkpoint
(--hf-overrides, --rope-scaling, --rope-theta) and the context length they allow.

Dynamic and longrope depend on the sequence length in transformers: our table row p is
transformers' rotation for a sequence p + 1 long (rope.py explains why), so parity is
exact when the prompt fits within the original length, and, for longer prompts, against
transformers fed one token at a time (its rotation then follows the position as ours
does); transformers given a long prompt in one forward rotates every prompt token with
the full length's base instead, which no paged engine reproduces.
"""

from __future__ import annotations

import inspect
import json
import logging
import shutil
import warnings

import pytest
import torch

from pagedllm.core.loader import apply_hf_overrides, derived_max_model_len
from pagedllm.plugins.models.layers import RotaryEmbedding as ReExported
from pagedllm.plugins.models.rope import (
    RotaryEmbedding,
    rope_cos_sin,
    rope_inv_freq,
    rope_parameters,
    yarn_attention_scale,
)
from tests.conftest import NATIVE_BACKEND, build_tiny_model
from tests.test_llm import assert_parity, hf_greedy, make_prompts, new_llm, run_engine

BACKENDS = ["TORCH", NATIVE_BACKEND]
HEAD_DIM = 16
SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
LONG = [1.5 + 0.5 * i for i in range(HEAD_DIM // 2)]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# (max_position_embeddings, rope dict) per case; positions up to 200 cover both sides of 64
TABLE_CASES = {
    "default": (64, {}),
    "linear": (64, {"rope_type": "linear", "factor": 2.0}),
    "dynamic": (64, {"rope_type": "dynamic", "factor": 4.0}),
    "yarn": (256, YARN),
    "yarn-beta-mscale": (256, {**YARN, "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0}),
    "yarn-no-factor-no-truncate": (256, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32,
                                         "truncate": False, "attention_factor": 1.3}),
    "longrope": (256, {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                       "original_max_position_embeddings": 64}),
    "longrope-attention-factor": (256, {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                        "original_max_position_embeddings": 64, "attention_factor": 0.9}),
    "llama3": (256, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64}),
}


def llama_config(max_pos: int, rope: dict, **kw):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                                        max_position_embeddings=max_pos,
                                        rope_parameters={"rope_theta": 10000.0, **rope} if rope else None, **kw)


@pytest.mark.parametrize("case", sorted(TABLE_CASES))
def test_tables_match_transformers_row_by_row(case):
    """Row p against transformers' LlamaRotaryEmbedding for a sequence of p + 1 tokens (its
    last row): for the static types every row of one forward, for dynamic and longrope the
    length-dependent rotation that transformers recomputes."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    max_pos, rope = TABLE_CASES[case]
    cfg = llama_config(max_pos, rope)
    theta, scaling = rope_parameters(cfg)
    num = 200
    ours = RotaryEmbedding(HEAD_DIM, num, theta, scaling, max_position_embeddings=max_pos)
    hf = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1)
    for p in range(num):  # increasing lengths: transformers' dynamic cache grows as in generation
        cos, sin = hf(x, torch.arange(p + 1)[None])
        torch.testing.assert_close(ours.cos[p], cos[0, -1, :HEAD_DIM // 2], atol=1e-5, rtol=0, msg=f"cos row {p}")
        torch.testing.assert_close(ours.sin[p], sin[0, -1, :HEAD_DIM // 2], atol=1e-5, rtol=0, msg=f"sin row {p}")
    looked_up = ours.lookup(torch.tensor([0, 5, 199]))
    assert torch.equal(looked_up[0], ours.cos[[0, 5, 199]])


@pytest.mark.parametrize("case", ["yarn", "yarn-beta-mscale", "longrope", "dynamic", "linear", "llama3"])
def test_inv_freq_matches_rope_init_functions(case):
    """rope_inv_freq is transformers' ROPE_INIT_FUNCTIONS (inv_freq and attention factor),
    at the original length and past it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    max_pos, rope = TABLE_CASES[case]
    cfg = llama_config(max_pos, rope)
    theta, scaling = rope_parameters(cfg)
    for seq_len in (None, 3 * max_pos):
        inv_freq, factor = rope_inv_freq(HEAD_DIM, theta, scaling, max_pos, seq_len=seq_len)
        hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, None, seq_len=seq_len)
        torch.testing.assert_close(inv_freq, hf_inv.float(), atol=0, rtol=1e-6)
        assert factor == pytest.approx(hf_factor)


def test_layers_module_keeps_the_rope_names():
    from pagedllm.plugins.models import layers, rope

    assert ReExported is RotaryEmbedding
    assert layers.rope_parameters is rope.rope_parameters and layers.rope_inv_freq is rope.rope_inv_freq


def test_unknown_rope_type_is_refused():
    with pytest.raises(NotImplementedError, match="'su2' is not supported yet"):
        rope_cos_sin(HEAD_DIM, 8, 10000.0, {"rope_type": "su2"})


def deepseek_config(rope: dict):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=8,
                                             qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=None,
                                             max_position_embeddings=256, rope_parameters={"rope_theta": 10000.0,
                                                                                          **rope})


@pytest.mark.parametrize("rope", [
    {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3's (cos/sin factor 1, softmax x mscale^2)
    {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    {**YARN, "mscale": 1.0, "mscale_all_dim": 0},  # no mscale_all_dim: plain softmax scale
    {"rope_type": "default"},
], ids=["v3", "mscale-differs", "no-all-dim", "default"])
def test_deepseek_scale_and_a_rotary_dim_smaller_than_the_head(rope):
    """What DeepSeek-V3 attention needs: yarn_attention_scale is transformers'
    yarn_apply_mscale multiplier, and tables for the rotated part only (qk_rope_head_dim=8
    of a 24-wide q.k head) match its rotary module."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    cfg = deepseek_config(rope)
    theta, scaling = rope_parameters(cfg)
    assert yarn_attention_scale(scaling) == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, 1.0))
    ours = RotaryEmbedding(cfg.qk_rope_head_dim, 256, theta, scaling, max_position_embeddings=256)
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(torch.zeros(1), torch.arange(256)[None])
    assert ours.cos.shape == (256, 4)
    torch.testing.assert_close(ours.cos, cos[0, :, :4], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin, sin[0, :, :4], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- context length


@pytest.mark.parametrize("max_pos,rope,expected", [
    (64, {}, 64),
    (64, {"rope_type": "linear", "factor": 2.0}, 128),
    (64, {"rope_type": "dynamic", "factor": 4.0}, 256),
    (64, YARN, 256),  # yarn added to a checkpoint stating its original length
    (1024, YARN, 1024),  # a checkpoint that already states the scaled length keeps it
    (256, {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
           "original_max_position_embeddings": 64}, 256),
    (256, TABLE_CASES["llama3"][1], 256),
])
def test_derived_max_model_len(max_pos, rope, expected):
    assert derived_max_model_len(llama_config(max_pos, rope))[0] == expected


def test_per_layer_type_rope_is_not_scaled():
    from types import SimpleNamespace

    cfg = SimpleNamespace(max_position_embeddings=128, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {"rope_type": "default"}})
    assert derived_max_model_len(cfg) == (128, "max_position_embeddings=128")


# ---------------------------------------------------------------------- overrides on a config


def test_overrides_merge_into_the_rope_dict_and_log(caplog):
    cfg = llama_config(64, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 16})
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        apply_hf_overrides(cfg, {"rope_scaling": YARN, "max_window_layers": 3, "rms_norm_eps": 1e-5})
    assert cfg.rope_parameters == {**YARN, "rope_theta": 10000.0}  # llama3's keys gone, the base kept
    assert cfg.rms_norm_eps == 1e-5
    assert "hf_overrides: rope_scaling = {'rope_type': 'yarn'" in caplog.text
    assert "max_window_layers is not a field of LlamaConfig; set anyway" in caplog.text
    apply_hf_overrides(cfg, {"rope_scaling": {"factor": 2.0}, "rope_theta": 1e6})  # same type: merged
    assert cfg.rope_parameters == {**YARN, "factor": 2.0, "rope_theta": 1e6}
    with pytest.raises(ValueError, match="rope_scaling must be a JSON object"):
        apply_hf_overrides(cfg, {"rope_scaling": 4})


# ---------------------------------------------------------------------- end to end


def build(path, arch: str, rope: dict | None, max_pos: int):
    extra = dict(head_dim=HEAD_DIM) if arch != "qwen3" else {}
    if rope:
        extra["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_model(path, arch, max_position_embeddings=max_pos, **extra)


_DIRS: dict = {}
_REFS: dict = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    def make(arch: str, kind: str):
        key = (arch, kind)
        if key not in _DIRS:
            max_pos, rope = {"yarn": (256, YARN), "dynamic": TABLE_CASES["dynamic"],
                             "longrope": TABLE_CASES["longrope"], "plain": (64, None)}[kind]
            _DIRS[key] = build(tmp_path_factory.mktemp(f"{arch}-{kind}"), arch, rope, max_pos)
        return _DIRS[key]
    return make


def reference(path, prompts, stepwise: bool = False):
    key = (str(path), tuple(map(tuple, prompts)), stepwise)
    if key not in _REFS:
        _REFS[key] = hf_greedy_stepwise(path, prompts) if stepwise else hf_greedy(path, prompts)
        assert all(len(set(tokens)) > 4 for tokens, _ in _REFS[key]), "a degenerate random model proves nothing"
    return _REFS[key]


def hf_greedy_stepwise(model_dir, prompts, num_tokens: int = 32):
    """transformers fed one token at a time (prompt included): each forward's sequence
    length is its token's position + 1, the rotation our tables hold for dynamic and longrope."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # transformers >= 5.24 calls the KV cache `cache` (`past_key_values` is deprecated)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = None
            for token in ids:
                past = {name: getattr(out, name)} if out is not None else {}
                out = model(torch.tensor([[token]]), use_cache=True, **past)
            tokens, logprobs = [], []
            for _ in range(num_tokens):
                row = torch.log_softmax(out.logits[0, -1].float(), -1)
                tokens.append(int(row.argmax()))
                logprobs.append(row)
                out = model(torch.tensor([[tokens[-1]]]), use_cache=True, **{name: getattr(out, name)})
            results.append((tokens, logprobs))
    return results


LONG_PROMPTS = make_prompts(seed=3, lens=[120, 70, 150, 3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_yarn_parity_past_the_original_length(model_dir, arch, backend):
    """yarn (original 64, factor 4): prompts up to 150 tokens and 32 more, plain and chunked."""
    path = model_dir(arch, "yarn")
    ref = reference(path, LONG_PROMPTS)
    plain = new_llm(path, attention_backend=backend)
    assert plain.engine.max_model_len == 256
    assert_parity(run_engine(plain, LONG_PROMPTS), ref)
    chunked = new_llm(path, attention_backend=backend, max_num_batched_tokens=16)
    assert_parity(run_engine(chunked, LONG_PROMPTS), ref)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_length_dependent_rope_parity(model_dir, kind, backend):
    """Prompts within the original 64 tokens whose generation runs past it: exact parity with
    transformers' ordinary run; prompts longer than 64: exact parity with transformers fed
    token by token (chunked prefill here, so the two regimes meet different chunkings)."""
    path = model_dir("llama", kind)
    short = make_prompts(seed=4, lens=[40, 50, 60])
    llm = new_llm(path, attention_backend=backend)
    assert llm.engine.max_model_len == 256  # dynamic: 64 x factor 4; longrope: max_position_embeddings
    assert_parity(run_engine(llm, short), reference(path, short))
    long = make_prompts(seed=5, lens=[100, 70])
    chunked = new_llm(path, attention_backend=backend, max_num_batched_tokens=16)
    assert_parity(run_engine(chunked, long), reference(path, long, stepwise=True))


def scaled_copy(src, dst, rope: dict):
    """`src` with `rope` written into its config.json: the reference for an override."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), **rope}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_hf_overrides_add_yarn_to_a_checkpoint(model_dir, tmp_path, caplog):
    """A checkpoint with max_position_embeddings=64 and no scaling: --hf-overrides with yarn
    stretches the context to 64 x 4 (prompts of 150 tokens load) with transformers' outputs
    for that config; the override is logged; without it the long prompts are refused."""
    path = model_dir("llama", "plain")
    with pytest.raises(ValueError, match="longer than max_model_len=64"):
        new_llm(path).generate([{"prompt_token_ids": LONG_PROMPTS[0]}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"max_model_len=128 is longer than the model's max_position_embeddings=64"):
        new_llm(path, max_model_len=128)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = new_llm(path, hf_overrides={"rope_scaling": YARN})
    assert "hf_overrides: rope_scaling = " in caplog.text
    assert llm.engine.max_model_len == 256
    assert llm.engine.hf_config.rope_parameters["rope_type"] == "yarn"
    ref = reference(scaled_copy(path, tmp_path / "yarn", YARN), LONG_PROMPTS)
    assert_parity(run_engine(llm, LONG_PROMPTS), ref)


def test_allow_long_max_model_len(model_dir, monkeypatch, caplog):
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's override): a context past the model's 64
    positions loads with a warning, and the rotary tables reach it, so prompts of 70 and 120
    tokens run; transformers' default rope has no table, so its outputs are the reference."""
    path = model_dir("llama", "plain")
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        new_llm(path, max_model_len=256)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = new_llm(path, max_model_len=256)
    assert "never trained" in caplog.text and llm.engine.max_model_len == 256
    prompts = LONG_PROMPTS[:2]
    assert_parity(run_engine(llm, prompts), hf_greedy(path, prompts))


def test_rope_flags_of_older_vllm(model_dir, tmp_path, caplog):
    """rope_scaling= and rope_theta= (vLLM's --rope-scaling / --rope-theta) act as
    hf_overrides, with a warning naming --hf-overrides; given twice is an error."""
    path = model_dir("llama", "plain")
    rope = {"rope_type": "linear", "factor": 2.0}
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = new_llm(path, rope_scaling=rope, rope_theta=5e4)
    assert "--rope-theta is vLLM's older spelling: it is applied as --hf-overrides" in caplog.text
    assert llm.engine.hf_config.rope_parameters == {**rope, "rope_theta": 5e4}
    assert llm.engine.max_model_len == 128
    prompts = make_prompts(seed=6, lens=[90, 20])
    assert_parity(run_engine(llm, prompts),
                  reference(scaled_copy(path, tmp_path / "linear", {**rope, "rope_theta": 5e4}), prompts))
    with pytest.raises(ValueError, match="rope_theta is given twice"):
        new_llm(path, rope_theta=5e4, hf_overrides={"rope_theta": 1e4})
