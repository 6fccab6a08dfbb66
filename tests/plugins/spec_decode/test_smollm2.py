"""Lossless on the real SmolLM2-135M (its float32 copy): greedy chats with every method
equal the chats without speculation, token for token, and the input-grounded chat has
most drafts accepted.

The bundled Q4_1 GGUF is not used here: there a verify step's rows go through the batched
bf16 GEMM while a lone decode row takes the exact Q4_1 kernel (ops/cpu/crossover.py), so
near-ties (top-2 logprobs within ~0.01) can flip, as they can between batch sizes.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests._eagle3 import write_head

CODE = '''def schedule(self):
    budget = self.max_num_batched_tokens
    scheduled = []
    while self.waiting and budget > 0:
        req = self.waiting.popleft()
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        scheduled.append((req, num_new))
        budget -= num_new
    return scheduled
'''
CHATS = [
    [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}],
    [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def baseline(smollm2_float):
    llm = LLM(str(smollm2_float), kv_cache_memory=256 << 20, max_model_len=1024)
    return [o.outputs[0] for o in llm.chat(CHATS, PARAMS, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    {"method": "suffix", "num_speculative_tokens": 8},
    "self",
    "eagle3",
], ids=["ngram", "suffix", "draft_model", "eagle3"])
def test_greedy_chats_unchanged(smollm2_float, baseline, config, tmp_path):
    if config == "self":
        config = {"model": str(smollm2_float), "num_speculative_tokens": 3}
    if config == "eagle3":  # an untrained head in the published layout: lossless, if rarely right
        config = {"method": "eagle3", "model": str(write_head(tmp_path / "head", smollm2_float)),
                  "num_speculative_tokens": 3}
    llm = LLM(str(smollm2_float), kv_cache_memory=256 << 20, max_model_len=1024, speculative_config={**config, "adaptive": False})
    got = [o.outputs[0] for o in llm.chat(CHATS, PARAMS, use_tqdm=False)]
    for i, (g, b) in enumerate(zip(got, baseline)):
        assert g.token_ids == b.token_ids, f"chat {i}: greedy tokens differ with {config['method'] if 'method' in config else 'a draft'}"
        assert g.text == b.text
        for step, (rg, rb) in enumerate(zip(g.logprobs, b.logprobs)):
            token = b.token_ids[step]
            assert rg[token].logprob == pytest.approx(rb[token].logprob, abs=1e-3), f"chat {i} step {step}"
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 0
    if config.get("method") != "eagle3":
        assert stats.num_accepted_tokens > 0.3 * len(baseline[0].token_ids), \
            f"the grounded chat should have many drafts accepted ({stats.num_accepted_tokens})"
