"""--calculate-kv-scales: FP8 KV-cache scales set from the first batch (vLLM's rule:
k_scale = max |k| / 200, v_scale = max |v| / 100), once, by each attention layer.

The model: a tiny random Llama whose k and v projections are multiplied by SCALE and whose
q and o projections are divided by it. Its logits are the unscaled model's (q.k and the
output are unchanged), but its keys and values reach ~1800, far past e4m3's 448: with
scales of 1.0 an FP8 cache saturates them; with calculated scales it stores them as well
as the unscaled model's cache stores its own. The CPU's default backend, CPU_ATTN, has no
FP8 cache (its check refuses one), so with an FP8 cache the CPU default is TORCH; TRITON
(interpreted here) reads the scales in its own kernels.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.core.contracts import (
    AttentionBackend,
    AttentionContext,
    AttentionImpl,
    AttentionMetadataBuilder,
    ModelContext,
)
from pagedllm.plugins.models.layers import K_SCALE_CONSTANT, V_SCALE_CONSTANT, Attention, KVScaleCalculation
from tests.conftest import TEST_DEVICE

SCALE = 200.0
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 61, 12, 33, 4, 9, 100, 200, 300], [301, 2, 77, 8, 9, 10]]
OTHER_PROMPT = [400, 401, 7, 402, 3, 9, 11, 500, 13]


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny Llama, its copy with keys and values SCALE times larger, same logits)."""
    plain = tiny_model_dir("llama")
    scaled = tmp_path_factory.mktemp("kv-scaled")
    shutil.copytree(plain, scaled, dirs_exist_ok=True)
    weights = load_file(scaled / "model.safetensors")
    for name in weights:
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            weights[name] = weights[name] * SCALE
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            weights[name] = weights[name] / SCALE
    save_file(weights, scaled / "model.safetensors", metadata={"format": "pt"})
    return plain, scaled


def engine(model_dir: Path, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", device=TEST_DEVICE, kv_cache_memory=1 << 22, **kwargs)


def prompt_logprobs(llm: LLM, prompts: list[list[int]] = PROMPTS) -> torch.Tensor:
    """The logprob of every prompt token after the first, all prompts in one step: each
    read back from the cache the step wrote (no sampled token, so no flip can part runs)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor([next(iter(entry.values())).logprob for out in outs for entry in out.prompt_logprobs[1:]])


def impls(llm: LLM) -> list[AttentionImpl]:
    return [m.impl for m in llm.engine.worker.model.modules() if isinstance(m, Attention)]


def scales(llm: LLM) -> list[tuple[float, float, str]]:
    return [(float(i.k_scale), float(i.v_scale), i.kv_scales_source) for i in impls(llm)]


@pytest.mark.parametrize("backend", [None, "TRITON"])
def test_calculated_scales_bring_an_fp8_cache_back_to_full_precision(models, backend):
    if backend == "TRITON":
        pytest.importorskip("triton")
    plain, scaled = models
    reference = prompt_logprobs(engine(scaled))
    given = {} if backend is None else {"attention_backend": backend}
    at_one = engine(scaled, kv_cache_dtype="fp8", **given)
    calculated = engine(scaled, kv_cache_dtype="fp8", calculate_kv_scales=True, **given)
    assert calculated.engine.worker.backend.name == (backend or "TORCH")  # the CPU default for an FP8 cache
    error_at_one = (prompt_logprobs(at_one) - reference).abs()
    error = (prompt_logprobs(calculated) - reference).abs()
    # what FP8 costs where nothing saturates: the unscaled model's cache at scale 1.0
    natural = (prompt_logprobs(engine(plain, kv_cache_dtype="fp8", **given)) - prompt_logprobs(engine(plain))).abs()
    # measured: mean 1.43 / max 3.76 nats at 1.0; 0.20 / 1.29 calculated; 0.16 / 0.71 unscaled
    assert error.mean() < error_at_one.mean() / 4, (error.mean(), error_at_one.mean())
    assert error.max() < error_at_one.max() / 2, (error.max(), error_at_one.max())
    assert error.mean() < 2 * natural.mean(), (error.mean(), natural.mean())
    assert all(source == "calculated" for _, _, source in scales(calculated))
    assert all(source == "default" and k == v == 1.0 for k, v, source in scales(at_one))


def test_scales_are_set_by_the_first_step_and_never_again(models):
    _, scaled = models
    llm = engine(scaled, kv_cache_dtype="fp8", calculate_kv_scales=True, attention_backend="TORCH")
    assert all(source == "default" for _, _, source in scales(llm)), "nothing measured before a step"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.engine.add_request("first", None, params, prompt_token_ids=PROMPTS[0])
    llm.engine.step()
    first = scales(llm)
    assert all(source == "calculated" for _, _, source in first)
    # layer 0's keys and values depend on the prompt alone: close to the rule's bound
    k0, v0, _ = first[0]
    assert 1000 / K_SCALE_CONSTANT < k0 < 4000 / K_SCALE_CONSTANT and 500 / V_SCALE_CONSTANT < v0
    llm.engine.add_request("second", None, params, prompt_token_ids=OTHER_PROMPT)
    while llm.engine.has_unfinished_requests():  # decodes, and a prefill with other values
        llm.engine.step()
    assert scales(llm) == first
    # a first batch of the other prompt gives other scales: a second measurement would show
    other = engine(scaled, kv_cache_dtype="fp8", calculate_kv_scales=True, attention_backend="TORCH")
    prompt_logprobs(other, [OTHER_PROMPT])
    assert [s[:2] for s in scales(other)] != [s[:2] for s in first]


def test_a_checkpoints_scales_win_over_calculation(models, tmp_path, caplog):
    _, scaled = models
    shutil.copytree(scaled, tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    for layer in range(2):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(7.5 + layer)
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(12.5 + layer)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = engine(tmp_path, kv_cache_dtype="fp8", calculate_kv_scales=True, attention_backend="TORCH")
        prompt_logprobs(llm)
    assert scales(llm) == [(7.5, 12.5, "given"), (8.5, 13.5, "given")]
    assert "layer 0 keeps the checkpoint's FP8 KV scales (k_scale=7.5, v_scale=12.5)" in caplog.text


def test_without_an_fp8_cache_the_flag_is_said_to_change_nothing(models, caplog):
    _, scaled = models
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = engine(scaled, calculate_kv_scales=True)
    assert "--calculate-kv-scales has no effect with kv_cache_dtype=auto" in caplog.text
    assert torch.equal(prompt_logprobs(llm), prompt_logprobs(engine(scaled)))
    assert all(s == (1.0, 1.0, "default") for s in scales(llm))


# ----------------------------------------------------------------- the layer alone


class RecordingImpl(AttentionImpl):
    """Records the scales each forward sees (what it would cache with); returns q."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[float, float]] = []

    def forward(self, q, k, v, kv_cache, metadata):
        self.seen.append((self.k_scale, self.v_scale))
        return q


class RecordingBackend(AttentionBackend):
    name = "RECORDING"

    @classmethod
    def check(cls, spec):
        return []

    @classmethod
    def builder_cls(cls):
        return AttentionMetadataBuilder

    @classmethod
    def impl_cls(cls):
        return RecordingImpl


def layer(kv_cache_dtype: str = "fp8") -> Attention:
    ctx = ModelContext(hf_config=None, dtype=torch.float32, device=torch.device("cpu"),
                       attention_backend=RecordingBackend, kv_cache_dtype=kv_cache_dtype)
    ctx.calculate_kv_scales = True  # what the worker sets from CacheConfig
    return Attention(ctx, 0, num_heads=2, num_kv_heads=1, head_dim=4, scale=0.5)


def step(attention: Attention, k_max: float, v_max: float, tokens: int = 3, dummy: bool = False) -> None:
    k = torch.full((tokens, 1, 4), 0.5)
    v = torch.full((tokens, 1, 4), -0.25)
    if tokens:
        k[-1, 0, 1], v[0, 0, 2] = -k_max, -v_max
    attention(torch.zeros(tokens, 2, 4), k, v, AttentionContext(None, [torch.empty(0)], dummy=dummy))


def test_the_layer_measures_the_first_real_step_before_caching_it():
    attention = layer()
    step(attention, 900.0, 300.0, dummy=True)  # the memory-profiling run: made-up tokens
    step(attention, 900.0, 300.0, tokens=0)  # a step without tokens for this layer
    step(attention, 800.0, 50.0)
    step(attention, 4000.0, 4000.0)
    k_scale, v_scale = 800.0 / K_SCALE_CONSTANT, 50.0 / V_SCALE_CONSTANT
    assert attention.impl.seen == [(1.0, 1.0), (1.0, 1.0), (k_scale, v_scale), (k_scale, v_scale)]
    assert attention.impl.kv_scales_source == "calculated"


def test_the_layer_keeps_given_scales_and_skips_an_all_zero_batch(caplog):
    attention = layer()
    attention.impl.k_scale, attention.impl.v_scale = 3.0, 4.0  # as the loader sets a checkpoint's
    step(attention, 900.0, 300.0)
    assert attention.impl.seen[-1] == (3.0, 4.0) and attention.impl.kv_scales_source == "given"
    zero = layer()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        zero(torch.zeros(2, 2, 4), torch.zeros(2, 1, 4), torch.full((2, 1, 4), 2.0),
             AttentionContext(None, [torch.empty(0)]))
    assert zero.impl.seen == [(1.0, 2.0 / V_SCALE_CONSTANT)]
    assert "layer 0's keys in the first batch are all zero; its scale stays 1" in caplog.text
    assert layer("auto").kv_scales is None  # an "auto" cache: nothing to calculate


def test_a_latent_layer_takes_the_key_scale_for_both():
    impl = RecordingImpl(ModelContext(hf_config=None, dtype=torch.float32, device=torch.device("cpu"),
                                      attention_backend=RecordingBackend, kv_cache_dtype="fp8")
                         .attention_spec(2, 1, 8, kind="mla"), 0.5)
    latent = torch.linspace(-600.0, 10.0, 16).reshape(2, 1, 8)
    assert KVScaleCalculation(3).decide(impl, latent, None, AttentionContext(None, []))
    assert (impl.k_scale, impl.v_scale) == (600.0 / K_SCALE_CONSTANT, 600.0 / K_SCALE_CONSTANT)
