"""EAGLE-1 heads in the published layout (`fc` 2H -> H over [embedding, the target's last
hidden state], `layers.N.*` with no input norm on the first, no final norm, the target's
lm_head) load and run losslessly through chunked prefill and the prefix cache; every draft
the proposer makes equals a direct transformers implementation of the head (which the
wrong variants — concatenation swapped, a first-layer norm, the target's hidden state
before its final norm as the feature — would not match); heads that do not fit the layout
are refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from tests._eagle1 import Reference, write_head
from tests._eagle3 import write_head as write_eagle3_head
from tests.plugins.spec_decode.test_parity import assert_same

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
SETTINGS = dict(kv_cache_memory=1 << 24, max_num_batched_tokens=16)  # prefill in chunks
# the published shape, and one with everything optional switched the other way
HEADS = {"one-layer": dict(),
         "two-layer-own-embedding": dict(num_layers=2, fc_bias=False, first_input_norm=False,
                                          own_embedding=True, own_lm_head=True)}


def prompts():
    return [{"prompt_token_ids": [5, 6, 7, 8] * 9}, {"prompt_token_ids": [9, 3, 200]},
            {"prompt_token_ids": [5, 6, 7, 8] * 9 + [11, 12]}]


def eagle(target, head, **settings) -> LLM:
    return LLM(str(target), **SETTINGS, **settings, speculative_config={
        "method": "eagle", "model": str(head), "num_speculative_tokens": 3, "adaptive": False})


@pytest.mark.parametrize("shape", HEADS)
def test_eagle_head_is_lossless(tiny_model_dir, tmp_path, shape):
    target = tiny_model_dir("llama")
    head = write_head(tmp_path / "head", target, **HEADS[shape])
    base = LLM(str(target), **SETTINGS).generate(prompts(), PARAMS, use_tqdm=False)
    engine = eagle(target, head)
    for _ in range(2):  # the second pass finds its prompts in the prefix cache
        assert_same(engine.generate(prompts(), PARAMS, use_tqdm=False), base, "EAGLE-1")
    stats = engine.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 2 * stats.num_drafts, \
        "k drafts per step (fewer near max_tokens)"
    assert engine.engine.worker.proposer.kv_cache_spec().num_layers == HEADS[shape].get("num_layers", 1)


@pytest.mark.parametrize("shape", HEADS)
def test_eagle_drafts_equal_a_direct_implementation(tiny_model_dir, tmp_path, shape):
    target = tiny_model_dir("llama")
    head = write_head(tmp_path / "head", target, **HEADS[shape])
    engine = eagle(target, head)
    proposer = engine.engine.worker.proposer
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def recording(batch):
        out = propose(batch)
        seen.extend((list(ids), drafts) for ids, drafts in zip(batch.token_ids, out) if drafts)
        return out

    proposer.propose = recording
    engine.generate(prompts()[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 8, "the proposer drafted at every decode step of both requests"
    assert any(len(tokens) == 37 for tokens, _ in seen), "a draft right after the chunked 36-token prompt"

    right = Reference(head, target)
    wrong = {m: Reference(head, target, m) for m in ("swapped", "first_norm", "prenorm_feature")}
    if shape == "two-layer-own-embedding":
        del wrong["first_norm"]  # this head ships no first-layer norm to misapply
    compared, caught = 0, set()
    for tokens, drafts in seen:
        expected, margins = right.drafts(tokens, len(drafts))
        sure = next((i for i, m in enumerate(margins) if m < 1e-3), len(margins))  # drafts before any near tie
        assert drafts[:sure] == expected[:sure], f"after {len(tokens)} tokens"
        compared += sure
        for mistake, ref in wrong.items():
            if ref.drafts(tokens, len(drafts))[0][:sure] != expected[:sure]:
                caught.add(mistake)
    assert compared >= 2 * len(seen), "most drafts were compared"
    assert caught == set(wrong), f"the comparison would not notice {set(wrong) - caught}"


def test_eagle_errors(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")

    def load(head):
        LLM(str(target), kv_cache_memory=1 << 24,
            speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 2})

    with pytest.raises(ValueError, match="layers.0.self_attn.rotary.weight"):
        load(write_head(tmp_path / "unknown", target, extra={"layers.0.self_attn.rotary.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match="'norm.weight' has no place"):
        load(write_head(tmp_path / "normed", target, extra={"norm.weight": torch.ones(64)}))
    with pytest.raises(ValueError, match=r"num_hidden_layers=1, its tensors the layers \[0, 1\]"):
        load(write_head(tmp_path / "layers", target, extra={"layers.1.mlp.down_proj.weight": torch.ones(64, 96)}))
    head = write_head(tmp_path / "short", target)
    tensors = load_file(str(head / "model.safetensors"))
    del tensors["layers.0.self_attn.k_proj.weight"]  # one shard of the fused q/k/v projection
    save_file(tensors, str(head / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing layers\.0\.self_attn\.k_proj\.weight$"):
        load(head)
    with pytest.raises(ValueError, match="EAGLE-3 head .*use \"method\": \"eagle3\""):
        load(write_eagle3_head(tmp_path / "eagle3", tiny_model_dir("llama", num_hidden_layers=4)))
