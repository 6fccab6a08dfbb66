"""The text side of Gemma3ForConditionalGeneration and Llama4ForConditionalGeneration
checkpoints against transformers' own ConditionalGeneration classes (input_ids only).

Tiny random vision-language models (tiny SigLIP / Llama 4 vision towers, so that
save_pretrained writes real vision and projector tensors) are saved with transformers,
which writes the older layout (language_model.model.*, vision_tower.* / vision_model.*);
one Gemma 3 copy is rewritten in the newer layout (model.language_model.*,
model.vision_tower.*, model.multi_modal_projector.*, lm_head.*), which transformers reads
too. Greedy tokens must equal transformers' and logprobs stay within 2e-3 through plain,
chunked-prefill, prefix-caching and preemption runs: Gemma 3 on TORCH and CPU_ATTN (TRITON instead on a GPU),
Llama 4 (chunked local attention) on TORCH. The text configs carry the features of the
text-model tests (Gemma 3: sliding and global layers with their own RoPE, soft-capped
logits, random norm weights; Llama 4: MoE, chunked attention, a NoPE layer, temperature
tuning), so a config or tensor read from the wrong place shows. The Gemma text config sets
a final logit soft-cap (8, below the random logits) that transformers' composite class does
not apply, unlike its Gemma3ForCausalLM: the parity shows pagedllm follows the composite."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import pytest
import torch

from tests._models import cached_builds
from tests.conftest import NATIVE_BACKEND, save_tokenizer
from tests.test_llm import NUM_TOKENS, PROMPT_LENS, assert_parity, make_prompts, new_llm, run_engine

GEMMA_PROMPT_LENS = [3, 17, 40, 1, 25]
GEMMA_TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=384, bos_token_id=0, eos_token_id=1,
    pad_token_id=1, sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=8.0,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})
SIGLIP = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
LLAMA4_TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=40, intermediate_size_mlp=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=2, attention_chunk_size=12, no_rope_layer_interval=4, attn_temperature_tuning=True,
    floor_scale=4, attn_scale=0.5, use_qk_norm=True, max_position_embeddings=448, initializer_range=0.3,
    bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=64))
LLAMA4_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     image_size=28, patch_size=14, vision_output_dim=16, projector_input_dim=16,
                     projector_output_dim=16)
# name -> (transformers class, its tie_word_embeddings, initializer_range, newer tensor layout)
MODELS = {
    "gemma3": ("Gemma3ForConditionalGeneration", False, 0.3, False),
    # Gemma's default tied head (a large init would make a tied model echo its input)
    "gemma3-tied-new-layout": ("Gemma3ForConditionalGeneration", True, 0.05, True),
    "llama4": ("Llama4ForConditionalGeneration", False, 0.3, False),
}
GEMMA_BACKENDS = ["TORCH", NATIVE_BACKEND]


def _newer_layout(name: str) -> str:
    """A transformers-saved (older) tensor name in the newer layout."""
    for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


_CLASS_OF: dict[str, str] = {}  # built directory -> its transformers class


def build(path: Path, name: str) -> Path:
    import transformers
    from safetensors.torch import load_file, save_file

    cls, tied, init, newer = MODELS[name]
    _CLASS_OF[str(path)] = cls
    torch.manual_seed(0)
    if cls.startswith("Gemma3"):
        config = transformers.Gemma3Config(
            text_config={**GEMMA_TEXT, "tie_word_embeddings": tied, "initializer_range": init},
            vision_config={"model_type": "siglip_vision_model", **SIGLIP}, mm_tokens_per_image=1,
            tie_word_embeddings=tied, initializer_range=init)
    else:
        config = transformers.Llama4Config(text_config={**LLAMA4_TEXT, "initializer_range": init},
                                           vision_config=LLAMA4_VISION, tie_word_embeddings=tied)
    model = getattr(transformers, cls)(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "language_model" in pname and "norm" in pname:  # transformers' zero / one init would hide a wrong norm
                param.normal_(1.0 if cls.startswith("Llama4") else 0.0, 0.3)
    model.save_pretrained(path)
    save_tokenizer(path)
    if newer:
        file = path / "model.safetensors"
        tensors = load_file(str(file))
        save_file({_newer_layout(k): v for k, v in tensors.items()}, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return cached_builds(tmp_path_factory, build)


_REFS: dict = {}


def reference(path: Path, prompts: list[list[int]], num_tokens: int = NUM_TOKENS):
    """(tokens, log-softmax rows) per prompt from transformers' ConditionalGeneration class
    (eager attention, float32), given input_ids only: an argmax loop over the KV-cached forward.
    transformers 5.24's Llama4ForConditionalGeneration.forward fails building its output
    object (it reads `image_outputs` off the language model's), so for Llama 4 the loop runs
    what that forward runs without images: the composite's token embedding, then its
    language_model on those embeddings."""
    import transformers

    key = (str(path), tuple(map(tuple, prompts)), num_tokens)
    if key in _REFS:
        return _REFS[key]
    cls = getattr(transformers, _CLASS_OF[str(path)])
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    if cls.__name__.startswith("Llama4"):
        def forward(ids, **kw):
            return model.language_model(inputs_embeds=model.get_input_embeddings()(ids), **kw)
    else:
        def forward(ids, **kw):
            return model(input_ids=ids, **kw)
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = forward(torch.tensor([ids]), use_cache=True)
            tokens, rows = [], []
            for _ in range(num_tokens):
                row = torch.log_softmax(out.logits[0, -1].float(), -1)
                tokens.append(int(row.argmax()))
                rows.append(row)
                out = forward(torch.tensor([[tokens[-1]]]), use_cache=True, **{cache_name: getattr(out, cache_name)})
            results.append((tokens, rows))
    _REFS[key] = results
    return results


def prompts_for(name: str, **kw) -> list[list[int]]:
    return make_prompts(lens=GEMMA_PROMPT_LENS if name.startswith("gemma") else PROMPT_LENS, **kw)


# --------------------------------------------------------------------------- guards on the test models


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoints_hold_the_vision_side_and_varied_references(model_dir, name):
    """The parity tests prove the renaming and the skipping only if the files really hold
    prefixed language-model tensors beside vision and projector tensors, and transformers'
    outputs are varied."""
    from safetensors import safe_open

    path = model_dir(name)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    newer = MODELS[name][3]
    lm = "model.language_model." if newer else "language_model.model."
    vision = ("model.vision_tower." if newer else "vision_tower.") if name.startswith("gemma") else "vision_model."
    projector = "model.multi_modal_projector." if newer else "multi_modal_projector."
    assert any(k.startswith(lm + "layers.3.") for k in keys)
    assert any(k.startswith(vision) for k in keys) and any(k.startswith(projector) for k in keys)
    assert not any(k.startswith("model.layers.") for k in keys)
    head = [k for k in keys if "lm_head" in k]
    assert head == ([] if MODELS[name][1] else ["lm_head.weight" if newer else "language_model.lm_head.weight"])
    ref = reference(path, prompts_for(name))
    assert all(len(set(tokens)) > 4 for tokens, _ in ref), [len(set(t)) for t, _ in ref]


# --------------------------------------------------------------------------- engine parity


def _backends(name: str) -> list[str]:
    return GEMMA_BACKENDS if name.startswith("gemma") else ["TORCH"]


CASES = [(name, backend) for name in MODELS for backend in _backends(name)]


@pytest.mark.parametrize("name, backend", CASES)
def test_greedy_parity(model_dir, name, backend):
    path = model_dir(name)
    prompts = prompts_for(name)
    llm = new_llm(path, attention_backend=backend)
    assert llm.engine.worker.backend.name == backend
    assert_parity(run_engine(llm, prompts), reference(path, prompts))


@pytest.mark.parametrize("name, backend", [c for c in CASES if c[0] != "gemma3-tied-new-layout"])
def test_chunked_prefill_parity(model_dir, name, backend):
    path = model_dir(name)
    prompts = prompts_for(name)
    llm = new_llm(path, attention_backend=backend, max_num_batched_tokens=16)
    assert_parity(run_engine(llm, prompts), reference(path, prompts))
    assert llm.engine.stats.num_steps > NUM_TOKENS + sum(map(len, prompts)) // 16 - 1


@pytest.mark.parametrize("name, backend", [c for c in CASES if c[0] != "gemma3-tied-new-layout"])
def test_prefix_caching_parity(model_dir, name, backend):
    path = model_dir(name)
    prompts = make_prompts(seed=1, lens=[5, 20, 3], shared_prefix=40)
    llm = new_llm(path, attention_backend=backend)
    first = run_engine(llm, prompts[:1])
    rest = run_engine(llm, prompts[1:])
    assert_parity(first + rest, reference(path, prompts))
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 32 for o in rest), [o.num_cached_tokens for o in rest]


@pytest.mark.parametrize("name, backend", [c for c in CASES if c[0] != "gemma3-tied-new-layout"])
def test_preemption_parity(model_dir, name, backend):
    path = model_dir(name)
    prompts = make_prompts(seed=2, lens=[40, 30, 50, 20, 60, 25])
    # 4 layers x 2 kv heads x head_dim x 4 bytes x 2 per token; 12 blocks of 16 tokens
    per_token = 4 * 2 * (32 if name.startswith("gemma") else 16) * 4 * 2
    llm = new_llm(path, attention_backend=backend, kv_cache_memory=12 * 16 * per_token, max_model_len=160)
    outputs = run_engine(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_parity(outputs, reference(path, prompts))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


# --------------------------------------------------------------------------- config and weights


@pytest.mark.parametrize("name", ["gemma3", "llama4"])
def test_engine_reads_the_text_config(model_dir, name):
    """The top level of a composite config states no vocabulary or context length: the
    engine and the KV-cache spec take them from text_config."""
    path = model_dir(name)
    llm = new_llm(path, attention_backend="TORCH")
    text = LLAMA4_TEXT if name == "llama4" else GEMMA_TEXT
    assert llm.engine.vocab_size == 512
    assert llm.engine.max_model_len == text["max_position_embeddings"]
    spec = llm.engine.worker.kv_spec
    assert (spec.num_layers, spec.num_heads, spec.head_size) == (4, 4, text["head_dim"])
    if name == "gemma3":
        assert spec.sliding_windows == (8, 8, None, 8)
    else:
        assert spec.attention_chunks == (12, 12, 12, None)


def test_vision_tensors_are_skipped_with_one_info_line(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        new_llm(model_dir("gemma3"), attention_backend="TORCH")
    lines = [r.getMessage() for r in caplog.records if "vision tower not loaded" in r.getMessage()]
    assert len(lines) == 1 and "pagedllm serves text only" in lines[0], lines


def test_unknown_tensors_are_refused(model_dir, tmp_path):
    """Only the vision tower and projector are skipped: any other tensor the text model
    lacks is an error naming it, never dropped silently."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = model_dir("llama4")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["audio_tower.proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="audio_tower.proj.weight"):
        new_llm(tmp_path, attention_backend="TORCH")


def test_a_text_only_config_is_refused():
    from transformers import Gemma3TextConfig

    from pagedllm.plugins.models.multimodal_text import Gemma3ForConditionalGeneration

    with pytest.raises(ValueError, match="text_config"):
        Gemma3ForConditionalGeneration.kv_cache_spec(Gemma3TextConfig(**GEMMA_TEXT))
