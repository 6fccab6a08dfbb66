"""DeepSeek-V2/V3 (MLA, absorbed form) over two gloo ranks against one rank: tensor parallel
(heads split: q_b_proj / q_proj and kv_b_proj by columns, o_proj by rows, the latent
down-projections whole; each rank caches the whole latent for its heads and absorbs its
heads' kv_b_proj; experts' intermediate slices, shared experts by columns / rows), expert
parallel (whole experts, the router and its correction bias whole) and two pipeline
stages (3 layers: 1 + 2). Logits within 1e-4 and the same greedy tokens over a prefill and
8 decode steps. The models are test_deepseek's: V3 (q LoRA, grouped sigmoid routing with
the correction bias), V2-Lite (no q LoRA, greedy softmax) and V2 with group-limited
routing (routed by the block itself, then `run_experts`). The one-rank reference is
anchored to transformers' greedy tokens."""

from __future__ import annotations

from types import SimpleNamespace

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
from tests.plugins.models.test_deepseek import BASE, MODELS, build_deepseek

NAMES = ("v3", "v2-lite", "v2-grouped")
HEADS = BASE["num_attention_heads"]
LATENT = BASE["kv_lora_rank"] + BASE["qk_rope_head_dim"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name in NAMES:
        version, overrides = MODELS[name]
        out[name] = str(build_deepseek(tmp_path_factory.mktemp(name), version, **overrides))
    return out


@pytest.fixture(scope="module")
def one_rank(checkpoints) -> dict[str, dict]:
    return {name: generate(ParallelState.single(), path) for name, path in checkpoints.items()}


def test_the_one_rank_reference_is_transformers_greedy(checkpoints, one_rank):
    assert_one_rank_is_transformers_greedy(checkpoints, one_rank)


@pytest.mark.parametrize("parallel", [ParallelLayout(2, 1), ParallelLayout(2, 1, enable_expert_parallel=True),
                                      ParallelLayout(1, 2)], ids=["tp2", "tp2-ep", "pp2"])
def test_two_ranks_give_one_ranks_logits_and_tokens(checkpoints, one_rank, parallel):
    assert_layout_decodes_what_one_rank_does(parallel, checkpoints, NAMES, one_rank)


def test_each_rank_holds_its_heads_and_the_whole_latent(checkpoints):
    path = checkpoints["v3"]
    whole = load_model(ParallelState.single(), path)
    rank1 = load_model(fake_state(2, 1, 1), path)
    a, w = rank1.model.layers[0].self_attn, whole.model.layers[0].self_attn
    assert a.num_heads == HEADS // 2
    qk = BASE["qk_nope_head_dim"] + BASE["qk_rope_head_dim"]
    assert a.q_b_proj.output_sizes == [HEADS // 2 * qk]
    assert a.kv_b_proj.output_sizes == [HEADS // 2 * (BASE["qk_nope_head_dim"] + BASE["v_head_dim"])]
    assert a.o_proj.input_size == HEADS // 2 * BASE["v_head_dim"]
    # the latent's down-projections are every rank's, whole
    assert a.kv_a_proj_with_mqa.output_sizes == [LATENT] and a.q_a_proj.output_sizes == [BASE["q_lora_rank"]]
    # the absorbed matrices are the second half of the heads' (rank 1's)
    torch.testing.assert_close(a._w_uk, w._w_uk[HEADS // 2:], rtol=0, atol=0)
    torch.testing.assert_close(a._w_uv, w._w_uv[HEADS // 2:], rtol=0, atol=0)
    assert a.attn.impl.spec.num_heads == HEADS // 2 and a.attn.impl.spec.kind == "mla"
    # a stage absorbs only its own layers
    stage1 = load_model(fake_state(1, 2, 1), path)
    assert stage1.model.layers[1].self_attn._w_uk is not None


def test_the_latent_cache_is_not_split():
    """Every rank caches the whole latent (for its share of the query heads): the per-rank
    KV bytes of tensor parallelism are one rank's; heads that do not divide are refused,
    and the core's check accepts MLA over two ranks."""
    from pagedllm.core.plugins import get_registry
    from pagedllm.core.worker import check_split
    from pagedllm.plugins.models.deepseek import DeepseekV3ForCausalLM

    cfg = SimpleNamespace(**BASE, architectures=["DeepseekV3ForCausalLM"])
    spec = DeepseekV3ForCausalLM.kv_cache_spec(cfg)
    per_rank = spec.for_tensor_parallel(2)
    assert (per_rank.num_heads, per_rank.num_kv_heads, per_rank.latent_size) == (HEADS // 2, 1, LATENT)
    assert per_rank.bytes_per_token(4) == spec.bytes_per_token(4) == BASE["num_hidden_layers"] * LATENT * 4
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        spec.for_tensor_parallel(3)
    for tp, pp in ((2, 1), (1, 2)):
        config = SimpleNamespace(parallel=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
        check_split(config, SimpleNamespace(hf_config=cfg), get_registry())


def test_the_engine_on_two_ranks_decodes_what_one_rank_does(checkpoints):
    """Through LLM (the worker's backend choice, check_split, per-rank KV sizing of the latent cache):
    tensor_parallel_size=2 decodes one rank's tokens and logprobs."""
    from tests.plugins.models.test_moe_parallel import assert_engine_decodes_what_one_rank_does

    assert_engine_decodes_what_one_rank_does(checkpoints["v3"], tensor_parallel_size=2)
