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


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama saved again in bf16, tokenizer and all. Its weights are drawn narrower
    than the other tests' (initializer_range 0.1, not 0.3): at 0.3 its greedy choices are so
    close that transformers' own bf16 run kept 1 of 8 prompts of its float32 run (at 0.05 the
    model repeats one or two tokens)."""
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir("llama", initializer_range=0.1)
    out = tmp_path_factory.mktemp("tiny-llama-bf16")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def test_engine_on_a_bf16_checkpoint_matches_transformers_float32_on_its_weights(bf16_model_dir):
    llm = LLM(str(bf16_model_dir), device="cpu", kv_cache_memory=1 << 24)
    worker = llm.engine.worker
    assert worker.dtype == torch.float32, "--dtype auto on a bf16 checkpoint computes in float32 on the CPU"
    gate_up = worker.model.model.layers[0].mlp.gate_up_proj
    with precision.matmul_precision(worker.matmul_precision):
        pays = cpu_ops.bf16_products_pay()
    if pays:
        assert isinstance(gate_up.packed, cpu_ops.PackedBF16), "bf16 weights stay bf16 where the CPU multiplies in bf16"
    else:
        assert isinstance(gate_up.packed, cpu_ops.PackedDense), "widened to float32 where bf16 products do not pay"
    assert "weight" not in gate_up._parameters, "the packed copy replaces the plain weight"
    embed = worker.model.model.embed_tokens
    assert embed.weight.dtype == torch.bfloat16, "the embedding keeps the checkpoint's 16 bits"
    rows = embed(torch.tensor([3, 0, 7]))
    assert rows.dtype == torch.float32 and torch.equal(rows, embed.weight[[3, 0, 7]].float())

    prompts = make_prompts()
    ref = hf_greedy(bf16_model_dir, prompts, dtype=torch.float32)  # the bf16 weights, exact float32 arithmetic
    assert all(len(set(tokens)) > 3 for tokens, _ in ref), "a degenerate reference would prove nothing"
    # teacher-forced: every position of transformers' continuation scored by the engine, so
    # one near-tie flipped early cannot hide (or excuse) the rest
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    scored = llm.generate([{"prompt_token_ids": p + tokens} for p, (tokens, _) in zip(prompts, ref)], params,
                          use_tqdm=False)
    worst, flips, positions = 0.0, 0, 0
    for out, prompt, (tokens, rows) in zip(scored, prompts, ref):
        for j, token in enumerate(tokens):
            record = out.prompt_logprobs[len(prompt) + j]
            worst = max(worst, abs(record[token].logprob - rows[j][token].item()))
            flips += max(record.items(), key=lambda kv: kv[1].logprob)[0] != token
            positions += 1
    # bf16 products and the bf16 KV cache round activations (as the checkpoint's own dtype
    # would everywhere): measured worst 0.014 and 2 of 256 argmax flips on AVX512-BF16
    # (`--dtype bfloat16` there: 0.024 and 0)
    assert worst < 0.05, f"logprobs differ from transformers float32 on the same weights by up to {worst:.3f}"
    assert flips <= positions // 32, f"{flips} of {positions} greedy choices differ from transformers float32"
    generated = llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    equal = sum(out.outputs[0].token_ids == tokens for out, (tokens, _) in zip(generated, ref))
    # measured 6 of 8, as transformers' own bf16 run against its float32 run
    assert equal >= 5, f"only {equal} of {len(prompts)} greedy continuations equal transformers float32's"
    graphs = [g for g in worker.graph_runner.graphs.values() if g is not None]
    assert graphs and all(g.program is not None for g in graphs), \
        "a step of native float32 kernels (the embedding lookup included) must replay as one C program"


def test_explicit_bfloat16_keeps_the_bf16_compute(bf16_model_dir):
    llm = LLM(str(bf16_model_dir), device="cpu", dtype="bfloat16", kv_cache_memory=1 << 24)
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
