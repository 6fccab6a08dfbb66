"""Llama 4 (text) over two gloo ranks against one rank: tensor parallel (attention heads,
dense and shared-expert MLPs by columns / rows, each routed expert's intermediate slice,
the vocabulary), expert parallel (whole experts per rank, the router replicated) and two
pipeline stages; logits within 1e-4 and the same greedy tokens over a prefill and 8
decode steps. The models are test_llama4's: chunked RoPE layers with L2 q/k norms, a
temperature-tuned NoPE layer, MoE layers of top-1 and top-2 sigmoid-scaled routing (the
experts stored as transformers' stacks [E, in, out]). The one-rank reference is anchored
to transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.parallel import ParallelLayout, ParallelState
from tests._models import held_experts
from tests._rank_model import (
    assert_layout_decodes_what_one_rank_does,
    assert_one_rank_is_transformers_greedy,
    fake_state,
    generate,
    load_model,
)
from tests.plugins.models.test_llama4 import TINY, build

NAMES = ("llama4", "llama4-top2")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: str(build(tmp_path_factory.mktemp(name), name)) for name in NAMES}


@pytest.fixture(scope="module")
def one_rank(checkpoints) -> dict[str, dict]:
    return {name: generate(ParallelState.single(), path) for name, path in checkpoints.items()}


def test_the_one_rank_reference_is_transformers_greedy(checkpoints, one_rank):
    assert_one_rank_is_transformers_greedy(checkpoints, one_rank)


@pytest.mark.parametrize("parallel", [ParallelLayout(2, 1), ParallelLayout(2, 1, enable_expert_parallel=True),
                                      ParallelLayout(1, 2)], ids=["tp2", "tp2-ep", "pp2"])
def test_two_ranks_give_one_ranks_logits_and_tokens(checkpoints, one_rank, parallel):
    assert_layout_decodes_what_one_rank_does(parallel, checkpoints, NAMES, one_rank)


def test_each_rank_holds_its_experts_and_heads(checkpoints):
    """Tensor parallel: every expert's half of the intermediate size; expert parallel: half
    the experts, whole; the router whole on every rank either way."""
    path = checkpoints["llama4"]
    whole = load_model(ParallelState.single(), path).model.layers[1].feed_forward
    experts, inter = TINY["num_local_experts"], TINY["intermediate_size"]
    tp = load_model(fake_state(2, 1, 1), path)
    block = tp.model.layers[1].feed_forward
    assert (tp.model.layers[1].self_attn.num_heads, tp.model.layers[1].self_attn.num_kv_heads) == (2, 1)
    (tp_w13, _), (whole_w13, whole_w2) = held_experts(block.experts), held_experts(whole.experts)
    assert tp_w13.shape == (experts, inter, TINY["hidden_size"])
    half = slice(inter // 2, inter)
    up = slice(inter + inter // 2, 2 * inter)
    torch.testing.assert_close(tp_w13, torch.cat([whole_w13[:, half], whole_w13[:, up]], dim=1), rtol=0, atol=0)
    x = torch.randn(5, TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # the packed router (its plain weight is gone) scores alike
        torch.testing.assert_close(block.router(x), whole.router(x), rtol=0, atol=0)
    from tests._rank_moe import fake_state as one_stage_state

    ep = load_model(one_stage_state(ParallelLayout(2, 1, enable_expert_parallel=True), 1), path)
    ep_w13, ep_w2 = held_experts(ep.model.layers[1].feed_forward.experts)
    assert ep_w13.shape == (experts // 2, 2 * inter, TINY["hidden_size"])
    torch.testing.assert_close(ep_w2, whole_w2[experts // 2:], rtol=0, atol=0)


def test_the_engine_on_two_ranks_decodes_what_one_rank_does(checkpoints):
    """Through LLM (the worker's backend choice, check_split, per-rank KV sizing):
    --enable-expert-parallel over two ranks decodes one rank's tokens and logprobs."""
    from tests.plugins.models.test_moe_parallel import assert_engine_decodes_what_one_rank_does

    assert_engine_decodes_what_one_rank_does(checkpoints["llama4-top2"], tensor_parallel_size=2,
                                             enable_expert_parallel=True)
