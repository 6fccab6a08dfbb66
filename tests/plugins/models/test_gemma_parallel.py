"""Gemma 3 (text) and Gemma 2 over two gloo ranks against one rank: tensor parallel (heads,
GeGLU MLP and vocabulary split; the final soft-cap binds on the gathered logits, the
embedding scale on the all-reduced rows) and two pipeline stages (the tied variant's last
stage loads its own copy of the embedding as its head). The models are test_gemma3's:
sliding and global layers with their own RoPE, (1 + w) norms, q/k norms (Gemma 3) or
attention soft-caps (Gemma 2); the Gemma 2 one has a vocabulary (509) that does not
divide, so the last rank's part is padded. The one-rank reference is anchored to
transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.parallel import ParallelLayout, ParallelState
from tests._rank_model import (
    assert_layout_decodes_what_one_rank_does,
    assert_one_rank_is_transformers_greedy,
    fake_state,
    generate,
    load_model,
)
from tests.plugins.models.test_gemma3 import FINAL_CAP, build_gemma

CASES = {
    "gemma3": dict(),  # untied head, final soft-cap
    "gemma3-tied": dict(seed=3),  # a seed whose tied model does not echo one token
    "gemma2": dict(vocab_size=509),  # attention soft-cap, final soft-cap, padded vocab part
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: str(build_gemma(tmp_path_factory.mktemp(name), name, **kw)) for name, kw in CASES.items()}


@pytest.fixture(scope="module")
def one_rank(checkpoints) -> dict[str, dict]:
    return {name: generate(ParallelState.single(), path) for name, path in checkpoints.items()}


def test_the_one_rank_reference_is_transformers_greedy(checkpoints, one_rank):
    """Anchors the reference, and checks the final soft-cap is in force (logits bounded by
    the cap, which the random models' raw logits exceed)."""
    assert_one_rank_is_transformers_greedy(checkpoints, one_rank)
    for name in checkpoints:
        if name != "gemma3-tied":
            assert one_rank[name]["logits"].abs().max() < FINAL_CAP, name


def test_tensor_parallel_gives_one_ranks_logits_and_tokens(checkpoints, one_rank):
    assert_layout_decodes_what_one_rank_does(ParallelLayout(2, 1), checkpoints, list(CASES), one_rank)


def test_two_stages_give_one_ranks_logits_and_tokens(checkpoints, one_rank):
    assert_layout_decodes_what_one_rank_does(ParallelLayout(1, 2), checkpoints, list(CASES), one_rank)


def test_each_rank_holds_its_part(checkpoints):
    """Heads and MLP halves per rank, the vocabulary's padded last part; a stage holds
    only its layers and the last stage its own copy of the tied embedding."""
    whole = load_model(ParallelState.single(), checkpoints["gemma2"])
    rank1 = load_model(fake_state(2, 1, 1), checkpoints["gemma2"])
    attn, mlp = rank1.model.layers[0].self_attn, rank1.model.layers[0].mlp
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert mlp.gate_up_proj.output_sizes == [64, 64] and mlp.down_proj.input_size == 64
    assert (rank1.lm_head.vocab_start, rank1.lm_head.vocab_end) == (255, 509)
    emb = rank1.model.embed_tokens.weight
    assert emb.shape[0] == 255 and torch.equal(emb[:254], whole.model.embed_tokens.weight[255:])
    assert not emb[254:].any()  # padding row
    last = load_model(fake_state(1, 2, 1), checkpoints["gemma3-tied"])
    tied = load_model(ParallelState.single(), checkpoints["gemma3-tied"])
    assert torch.equal(last.lm_head.weight, tied.model.embed_tokens.weight)
    assert [i for i, layer in enumerate(last.model.layers) if list(layer.parameters())] == [2, 3]


def test_the_engine_on_two_ranks_decodes_what_one_rank_does(checkpoints):
    """Through LLM (the worker's backend choice, check_split, per-rank KV sizing):
    tensor_parallel_size=2 decodes one rank's tokens and logprobs."""
    from tests.plugins.models.test_moe_parallel import assert_engine_decodes_what_one_rank_does

    assert_engine_decodes_what_one_rank_does(checkpoints["gemma3"], tensor_parallel_size=2)
