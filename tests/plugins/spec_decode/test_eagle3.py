"""EAGLE-3 heads in the published layout (`midlayer.*`, `fc` 3H -> H, a 2H-wide first
attention, `d2t` / `t2d`, with or without their own embedding) load and run losslessly:
greedy output equals the output without speculation, through chunked prefill and the
prefix cache; a head with an unknown tensor is refused by name."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests._eagle3 import write_head
from tests.plugins.spec_decode.test_parity import assert_same

TARGET = dict(num_hidden_layers=4)  # the default feature layers (2, L // 2, L - 3) = (2, 2, 1)


PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


def prompts():
    return [{"prompt_token_ids": [5, 6, 7, 8] * 9}, {"prompt_token_ids": [9, 3, 200]},
            {"prompt_token_ids": [5, 6, 7, 8] * 9 + [11, 12]}]


@pytest.mark.parametrize("own_embedding", [False, True])
def test_eagle3_head_is_lossless(tiny_model_dir, tmp_path, own_embedding):
    target = tiny_model_dir("llama", **TARGET)
    head = write_head(tmp_path / "head", target, own_embedding=own_embedding)
    settings = dict(kv_cache_memory=1 << 24, max_num_batched_tokens=16)  # prefill in chunks
    base = LLM(str(target), **settings).generate(prompts(), PARAMS, use_tqdm=False)
    engine = LLM(str(target), **settings, speculative_config={
        "method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False})
    for _ in range(2):  # the second pass finds its prompts in the prefix cache
        assert_same(engine.generate(prompts(), PARAMS, use_tqdm=False), base, "EAGLE-3")
    stats = engine.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 2 * stats.num_drafts, "k drafts per step (fewer near max_tokens)"
    kept = set((torch.arange(384) + engine.engine.worker.proposer.head.d2t.cpu()).tolist())
    assert len(kept) == 384, "d2t maps the draft vocabulary onto distinct target ids"


def test_eagle3_errors(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama", **TARGET)
    bad = write_head(tmp_path / "bad", target, extra={"midlayer.self_attn.rotary.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="midlayer.self_attn.rotary.weight"):
        LLM(str(target), kv_cache_memory=1 << 24,
            speculative_config={"method": "eagle3", "model": str(bad), "num_speculative_tokens": 2})
