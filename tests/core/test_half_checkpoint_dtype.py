"""A bf16 / float16 checkpoint under `--dtype auto` on the CPU (core/worker.py
`resolve_dtype`, `dense_weight_dtype`): it computes in float32 over its dense weights kept in
bf16, which the CPU plugin multiplies in bf16 where the CPU has bf16 products and widens to
float32 elsewhere. Checked against transformers in float32 on the same bf16 weights (the
exact result those weights define), and against the rules for every other load."""

from __future__ import annotations

import shutil

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core import precision
from pagedllm.core.worker import dense_weight_dtype, resolve_dtype
from pagedllm.plugins.cpu_native import ops as cpu_ops
from tests.test_llm import NUM_TOKENS, hf_greedy, make_prompts


class _Config:
    def __init__(self, dtype):
        self.torch_dtype = dtype


@pytest.mark.parametrize("saved", ["bfloat16", "float16"])
def test_a_16_bit_checkpoint_computes_in_float32_over_bf16_weights_on_the_cpu(saved):
    cfg = _Config(saved)
    assert resolve_dtype("auto", cfg, "cpu") == torch.float32
    assert dense_weight_dtype("auto", cfg, "cpu", False) == torch.bfloat16


def test_other_loads_keep_their_dtype_and_weights():
    bf16, f16, f32 = _Config("bfloat16"), _Config("float16"), _Config("float32")
    assert resolve_dtype("bfloat16", bf16, "cpu") == torch.bfloat16, "an explicit --dtype is kept"
    assert dense_weight_dtype("bfloat16", bf16, "cpu", False) is None
    assert resolve_dtype("auto", bf16, "cuda") == torch.bfloat16, "GPUs compute in the checkpoint's dtype"
    assert dense_weight_dtype("auto", bf16, "cuda", False) is None
    assert resolve_dtype("auto", bf16, "cpu", quantized=True) == torch.bfloat16, "a quantizer's own dtype rule"
    assert resolve_dtype("auto", f16, "cpu", quantized=True) == torch.bfloat16
    assert dense_weight_dtype("auto", f16, "cpu", True) is None
    assert resolve_dtype("auto", f32, "cpu") == torch.float32 and dense_weight_dtype("auto", f32, "cpu", False) is None


def test_precision_policy_for_half_weights():
    assert precision.resolve(None, "auto", False, half_weights=True)[0] == "medium"
    assert precision.resolve("highest", "auto", False, half_weights=True)[0] == "highest", "the override wins"
    assert precision.dense_weight_dtype() is None
    with precision.matmul_precision("medium", torch.bfloat16):
        assert precision.dense_weight_dtype() == torch.bfloat16
        with precision.matmul_precision("highest"):
            assert precision.dense_weight_dtype() is None
        assert precision.dense_weight_dtype() == torch.bfloat16
    assert precision.dense_weight_dtype() is None


def _bf16_copy(src, out):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir, tmp_path_factory):
    """name -> a tiny model saved in bf16, tokenizer and all: "llama" (tied embedding),
    "qwen2" (untied lm_head, q/k/v bias), "qwen3moe" (every layer's MLP 8 experts, top 2).
    Their weights are drawn narrower than the other tests' (initializer_range 0.1, not 0.3):
    at 0.3 the tiny llama's greedy choices are so close that transformers' own bf16 run kept 1
    of 8 prompts of its float32 run (at 0.05 the model repeats one or two tokens)."""
    from tests._models import save_hf_model
    from tests.plugins.models.test_qwen_moe import MODELS, TINY

    built = {}

    def make(name):
        if name not in built:
            if name == "qwen3moe":
                cls, cfg_cls, extra = MODELS[name]
                src = save_hf_model(tmp_path_factory.mktemp("tiny-moe"), cls, cfg_cls,
                                    {**TINY, **extra, "initializer_range": 0.1})
            else:
                src = tiny_model_dir(name, initializer_range=0.1)
            built[name] = _bf16_copy(src, tmp_path_factory.mktemp(f"tiny-{name}-bf16"))
        return built[name]

    return make


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3moe"])
def test_engine_on_a_bf16_checkpoint_matches_transformers_float32_on_its_weights(bf16_model_dir, name):
    model_dir = bf16_model_dir(name)
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=1 << 24)
    worker = llm.engine.worker
    assert worker.dtype == torch.float32, "--dtype auto on a bf16 checkpoint computes in float32 on the CPU"
    layer = worker.model.model.layers[0]
    with precision.matmul_precision(worker.matmul_precision):
        pays = cpu_ops.bf16_products_pay()
    if name == "qwen3moe":
        experts = layer.mlp.experts.packed_experts
        want = cpu_ops.PackedExpertsBF16 if pays else cpu_ops.PackedExperts
        assert isinstance(experts, want), f"experts packed as {type(experts).__name__}"
    else:
        gate_up = layer.mlp.gate_up_proj
        want = cpu_ops.PackedBF16 if pays else cpu_ops.PackedDense  # widened where bf16 products do not pay
        assert isinstance(gate_up.packed, want), f"gate_up packed as {type(gate_up.packed).__name__}"
        assert "weight" not in gate_up._parameters, "the packed copy replaces the plain weight"
    embed = worker.model.model.embed_tokens
    assert embed.weight.dtype == torch.bfloat16, "the embedding keeps the checkpoint's 16 bits"
    rows = embed(torch.tensor([3, 0, 7]))
    assert rows.dtype == torch.float32 and torch.equal(rows, embed.weight[[3, 0, 7]].float())

    prompts = make_prompts()
    ref = hf_greedy(model_dir, prompts, dtype=torch.float32)  # the bf16 weights, exact float32 arithmetic
    assert sum(len(set(tokens)) > 3 for tokens, _ in ref) >= 6, "a degenerate reference would prove nothing"
    # teacher-forced: every position of transformers' continuation scored by the engine, so
    # one near-tie flipped early cannot hide (or excuse) the rest
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    scored = llm.generate([{"prompt_token_ids": p + tokens} for p, (tokens, _) in zip(prompts, ref)], params,
                          use_tqdm=False)
    errors, flips = [], 0
    for out, prompt, (tokens, rows) in zip(scored, prompts, ref):
        for j, token in enumerate(tokens):
            record = out.prompt_logprobs[len(prompt) + j]
            errors.append(abs(record[token].logprob - rows[j][token].item()))
            flips += max(record.items(), key=lambda kv: kv[1].logprob)[0] != token
    # bf16 products and the bf16 KV cache round activations (as the checkpoint's own dtype
    # would everywhere). Measured on AVX512-BF16, worst error / argmax flips of 256: llama
    # 0.014 / 2, qwen2 0.021 / 0, qwen3moe 0.073 / 3, where 0.073 is one position whose
    # experts' choice was a near tie (the next largest error 0.015; with float32 products,
    # PAGEDLLM_FLOAT32_MATMUL_PRECISION=highest, it is 0.0). `--dtype bfloat16` on llama: 0.024 / 0.
    large = sum(e > 0.05 for e in errors)
    assert max(errors) < 0.25 and large <= len(errors) // 100, \
        f"logprobs differ from transformers float32 on the same weights by up to {max(errors):.3f} " \
        f"({large} of {len(errors)} positions over 0.05)"
    assert flips <= len(errors) // 32, f"{flips} of {len(errors)} greedy choices differ from transformers float32"
    generated = llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    equal = sum(out.outputs[0].token_ids == tokens for out, (tokens, _) in zip(generated, ref))
    # measured 6 / 8 / 5 of 8 (llama: as transformers' own bf16 run against its float32 run); one
    # early near-tie changes a whole continuation, so the teacher-forced checks above are the strict ones
    assert equal >= 4, f"only {equal} of {len(prompts)} greedy continuations equal transformers float32's"
    if name != "qwen3moe":  # bf16 experts run one expert at a time through torch
        graphs = [g for g in worker.graph_runner.graphs.values() if g is not None]
        assert graphs and all(g.program is not None for g in graphs), \
            "a step of native float32 kernels (the embedding lookup included) must replay as one C program"


def test_explicit_bfloat16_keeps_the_bf16_compute(bf16_model_dir):
    llm = LLM(str(bf16_model_dir("llama")), device="cpu", dtype="bfloat16", kv_cache_memory=1 << 24)
    assert llm.engine.worker.dtype == torch.bfloat16


def test_packing_a_bf16_weight_for_float32_compute_without_bf16_products_widens_it(monkeypatch):
    """Where bf16 products do not pay (a CPU without them, or "highest" precision), the
    float32 panels multiply the bf16 values exactly."""
    from pagedllm import ops

    monkeypatch.setattr(cpu_ops, "bf16_products_pay", lambda: False)
    weight, x = torch.randn(40, 24).bfloat16(), torch.randn(3, 24)
    want = torch.nn.functional.linear(x.double(), weight.double()).float()
    with precision.matmul_precision("highest", torch.bfloat16):
        if cpu_ops._packed_bf16_here(torch.device("cpu"), torch.bfloat16) == []:
            packed = cpu_ops.pack_bf16_linear(weight)
            assert isinstance(packed, cpu_ops.PackedDense)
            torch.testing.assert_close(packed(x, None), want, rtol=1e-5, atol=1e-5)
        reference = ops._pack_linear(weight)  # the torch reference widens once as well
        assert reference.owns_copy and reference.weight.dtype == torch.float32
        torch.testing.assert_close(reference(x, None), want, rtol=1e-5, atol=1e-5)
