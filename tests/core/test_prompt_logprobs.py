"""prompt_logprobs against transformers: every prompt position's log-softmax, through
chunked prefill (rows accumulated over steps), a prefix-cache hit (bypassed: the rows
must be computed), and preemption (recomputed rows are not recorded twice)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import TEST_DEVICE

PROMPT = [3, 8, 22, 9, 41, 7, 300, 12, 5, 77, 18, 2, 90, 61, 33, 4, 150, 26, 8, 71, 19, 48, 250, 6, 11, 93, 37,
          14, 222, 58, 3, 100, 64, 29, 8, 17, 410, 55]


@pytest.fixture(scope="module")
def hf_rows(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def check(out, hf_rows, k: int) -> None:
    records = out.prompt_logprobs
    assert records is not None and len(records) == len(PROMPT) and records[0] is None
    for pos, record in enumerate(records[1:], 1):
        row = hf_rows[pos - 1]
        token = PROMPT[pos]
        assert abs(record[token].logprob - float(row[token])) < 2e-3, f"position {pos}"
        assert record[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist()
        ranked = sorted((lp.rank, tid) for tid, lp in record.items() if lp.rank <= k)
        assert [tid for _, tid in ranked][:k] == top[:len(ranked)] or len(set(row.topk(k + 1).values.tolist())) <= k


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(tiny_model_dir, hf_rows, settings):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device=TEST_DEVICE, enforce_eager=True, **settings)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    first = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    check(first, hf_rows, 3)
    again = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]  # would hit the prefix cache
    check(again, hf_rows, 3)
    assert again.num_cached_tokens == 0
    plain = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=2),
                         use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == first.outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(tiny_model_dir, hf_rows):
    """Few blocks: the requests preempt each other and recompute their prompts."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device=TEST_DEVICE, enforce_eager=True,
              kv_cache_memory=8 * 16 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=16, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "no preemption happened: the test proves nothing"
    for out in outs:
        check(out, hf_rows, 1)
