"""Whole-engine checks of the attention backends on a tiny random Llama (float32, CPU).

TRITON (interpreted here, see conftest.py) must give TORCH's greedy tokens and logprobs
through prefill and decode steps. An FP8 KV cache on TORCH must stay close to the
full-precision cache and hold more tokens in the same memory.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import TEST_DEVICE

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 61, 12, 33], [301, 2, 77]]
NUM_TOKENS = 8
# FP8 e4m3 keeps 3 mantissa bits (relative error up to 1/16 per cached element). This tiny
# random model has large, sharp attention logits, so that moves its logprobs by up to ~0.4
# nats (measured: 0.42 worst, 0.2 typical); greedy picks 0.02 apart may flip.
FP8_LOGPROB_ATOL = 0.5


def generate(model_dir, **kwargs):
    kwargs.setdefault("kv_cache_memory", 1 << 22)
    llm = LLM(str(model_dir), dtype="float32", device=TEST_DEVICE, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
    return llm, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def logprob_rows(output):
    return [{t: lp.logprob for t, lp in step.items()} for step in output.outputs[0].logprobs]


def test_triton_matches_torch(tiny_model_dir):
    pytest.importorskip("triton")
    model_dir = tiny_model_dir("llama")
    llm, got = generate(model_dir, attention_backend="TRITON")
    assert llm.engine.worker.backend.name == "TRITON"
    _, expected = generate(model_dir, attention_backend="TORCH")
    for out, ref in zip(got, expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for row, ref_row in zip(logprob_rows(out), logprob_rows(ref)):
            assert row.keys() == ref_row.keys()
            for token, logprob in row.items():
                assert logprob == pytest.approx(ref_row[token], abs=1e-4)


def test_fp8_kv_cache_is_close_and_holds_more_tokens(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    full_llm, full = generate(model_dir, attention_backend="TORCH")
    fp8_llm, fp8 = generate(model_dir, attention_backend="TORCH", kv_cache_dtype="fp8")
    assert fp8_llm.engine.worker.kv_caches[0].dtype == torch.float8_e4m3fn
    # same bytes, 1-byte elements instead of 4: four times the tokens (twice those of a 16-bit cache)
    assert fp8_llm.engine.worker.budget.num_tokens == 4 * full_llm.engine.worker.budget.num_tokens
    for out, ref in zip(fp8, full):
        tokens, ref_tokens = out.outputs[0].token_ids, ref.outputs[0].token_ids
        # compare up to and including the first flip: after it the contexts differ
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens) - 1)
        for row, ref_row in list(zip(logprob_rows(out), logprob_rows(ref)))[:agree + 1]:
            for token in row.keys() & ref_row.keys():
                assert row[token] == pytest.approx(ref_row[token], abs=FP8_LOGPROB_ATOL)


def test_fp8_halves_a_16_bit_cache(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    budgets = {}
    for kv_cache_dtype in ("auto", "fp8_e5m2"):
        llm = LLM(str(model_dir), dtype="bfloat16", device="cpu", kv_cache_memory=1 << 22,
                  attention_backend="TORCH", kv_cache_dtype=kv_cache_dtype)
        budgets[kv_cache_dtype] = llm.engine.worker.budget.num_tokens
    assert budgets["fp8_e5m2"] == 2 * budgets["auto"]
