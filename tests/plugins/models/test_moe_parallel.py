"""Tensor- and expert-parallel routed experts (pagedllm/plugins/models/moe.py) on two gloo
ranks against one rank: FusedMoE with DeepSeek-V3's routing, the Qwen3-MoE sparse block and
the Qwen2-MoE one (shared expert), each loaded from full checkpoint tensors in another
layout (GGUF stacks, per-expert tensors, transformers' fused stacks); what each rank holds;
the refusals (quantized experts, sizes that do not split); and whole tiny Qwen-MoE models
through the engine on two ranks (tensor, expert, pipeline parallel) decoding exactly what
one rank does."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, ops
from pagedllm.core.parallel import ParallelLayout, ParallelState
from pagedllm.plugins.models.moe import FusedMoE
from tests import _rank_moe as rm
from tests._distributed import run_ranks

E, I = rm.NUM_EXPERTS, rm.INTER
CASES = ("deepseek-layer", "qwen3-block", "qwen2-block")


@pytest.fixture(scope="module")
def inputs():
    tensors = rm.checkpoint(seed=0)
    x = torch.randn(7, rm.HIDDEN, generator=torch.Generator().manual_seed(1))
    return tensors, x, rm.run_cases(ParallelState.single(), tensors, x)


def ranks(layout: ParallelLayout, tensors: dict, x: torch.Tensor) -> list[dict]:
    """rm.run_cases on every rank of `layout`, its arrays back as tensors."""
    got = run_ranks(rm.run_cases, layout, tensors, x)
    for result in got:
        for held in result.values():
            for key in ("out", "w13", "w2"):
                held[key] = torch.from_numpy(held[key])
    return got


def assert_outputs_match(got: list[dict], want: dict) -> None:
    for rank, result in enumerate(got):
        for name in CASES:
            expected = torch.from_numpy(want[name]["out"])
            assert expected.abs().max() > 0.1, name  # a layer that outputs ~0 proves nothing
            torch.testing.assert_close(result[name]["out"], expected, rtol=0, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def test_tensor_parallel_matches_one_rank(inputs):
    tensors, x, want = inputs
    got = ranks(ParallelLayout(2, 1), tensors, x)
    assert_outputs_match(got, want)
    gate, up, down = (rm.expert_stack(tensors, p) for p in ("gate_proj", "up_proj", "down_proj"))
    half = slice(0, I // 2), slice(I // 2, I)
    for rank, result in enumerate(got):
        for name in CASES:
            held = result[name]
            assert held["params"]["w13_weight"] == (E, I, rm.HIDDEN)  # [gate_r; up_r] of every expert
            assert held["params"]["w2_weight"] == (E, rm.HIDDEN, I // 2)
            rows = half[rank]
            torch.testing.assert_close(held["w13"], torch.cat([gate[:, rows], up[:, rows]], dim=1), rtol=0, atol=0)
            torch.testing.assert_close(held["w2"], down[:, :, rows], rtol=0, atol=0)


def test_expert_parallel_matches_one_rank(inputs):
    tensors, x, want = inputs
    got = ranks(ParallelLayout(2, 1, enable_expert_parallel=True), tensors, x)
    assert_outputs_match(got, want)
    w13 = torch.cat([rm.expert_stack(tensors, "gate_proj"), rm.expert_stack(tensors, "up_proj")], dim=1)
    down = rm.expert_stack(tensors, "down_proj")
    for rank, result in enumerate(got):
        mine = slice(rank * E // 2, (rank + 1) * E // 2)
        for name in CASES:
            held = result[name]
            assert held["split"].first_expert == rank * E // 2
            assert held["params"]["w13_weight"] == (E // 2, 2 * I, rm.HIDDEN)  # only this rank's experts
            assert held["params"]["w2_weight"] == (E // 2, rm.HIDDEN, I)
            # the routing bias scores every expert: it stays whole on every rank
            if name == "deepseek-layer":
                assert held["params"]["e_score_correction_bias"] == (E,)
            torch.testing.assert_close(held["w13"], w13[mine], rtol=0, atol=0)
            torch.testing.assert_close(held["w2"], down[mine], rtol=0, atol=0)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_quantized_experts_are_refused_over_two_ranks(expert_parallel):
    from pagedllm.plugins.models.qwen_moe import Qwen3MoeSparseBlock
    from pagedllm.plugins.quant.gguf_linear import GGUFConfig

    quant = GGUFConfig.from_config({}, {})
    Qwen3MoeSparseBlock(rm.make_context(ParallelState.single(), quant), 0, rm.PREFIX)  # one rank: fine
    state = rm.fake_state(ParallelLayout(2, 1, enable_expert_parallel=expert_parallel), 0)
    with pytest.raises(NotImplementedError,
                       match=r"quantized experts \(GGUFMoEMethod\) with tensor_parallel_size > 1 are not supported"):
        Qwen3MoeSparseBlock(rm.make_context(state, quant), 0, rm.PREFIX)


def test_sizes_that_do_not_split_are_refused():
    ep = rm.make_context(rm.fake_state(ParallelLayout(2, 1, enable_expert_parallel=True), 0))
    with pytest.raises(ValueError, match=r"number of experts divisible by 2, the model has 5"):
        FusedMoE(ep, 5, 2, rm.HIDDEN, I, rm.PREFIX, renormalize=True)
    tp = rm.make_context(rm.fake_state(ParallelLayout(2, 1), 0))
    with pytest.raises(ValueError, match=r"does not divide the experts' intermediate size 15"):
        FusedMoE(tp, E, 2, rm.HIDDEN, 15, rm.PREFIX, renormalize=True)
    FusedMoE(ep, E, 2, rm.HIDDEN, 15, rm.PREFIX, renormalize=True)  # whole experts: any intermediate size


def test_expert_parallel_loads_only_its_experts_and_names_missing_ones_globally():
    tensors = rm.checkpoint(seed=0)
    del tensors[f"{rm.PREFIX}.experts.6.down_proj.weight"]
    layout = ParallelLayout(2, 1, enable_expert_parallel=True)
    # rank 0 holds experts 0-3: expert 6's tensors are not its concern
    rm.load(rm.deepseek_layer(rm.make_context(rm.fake_state(layout, 0))), f"{rm.PREFIX}.experts", tensors)
    with pytest.raises(ValueError, match=r"experts\.6\.down_proj\.weight"):
        rm.load(rm.deepseek_layer(rm.make_context(rm.fake_state(layout, 1))), f"{rm.PREFIX}.experts", tensors)


def test_expert_rows_skips_pairs_of_weight_zero():
    """Expert parallelism gives other ranks' experts weight 0: the CPU path must not run them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 8, generator=g)
    ids = torch.randint(0, 4, (9, 2), generator=g)
    ids[0] = torch.tensor([3, 1])
    weights = torch.rand(9, 2, generator=g)
    weights[ids == 3] = 0.0
    scale = torch.arange(1.0, 5.0)
    ran = []

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        ran.append(e)
        return rows * scale[e]

    got = ops.moe.expert_rows(x, weights, ids, 4, expert)
    want = (weights[..., None] * x[:, None, :] * scale[ids][..., None]).sum(dim=1)
    torch.testing.assert_close(got, want)
    assert 3 not in ran and ran


# ------------------------------------------------------------------ whole models, engine on 2 ranks

TINY_MOE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, initializer_range=0.3, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                tie_word_embeddings=False)
MODELS = {
    # every layer sparse, top-2 of 8 not renormalized
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(head_dim=16)),
    # layer 0 a dense MLP (decoder_sparse_step=2), then the shared expert beside the routed ones
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                 dict(shared_expert_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=True)),
}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from tests._models import cached_builds, save_hf_model

    def build(path, name):
        cls, cfg_cls, extra = MODELS[name]
        return save_hf_model(path, cls, cfg_cls, {**TINY_MOE, **extra})

    return cached_builds(tmp_path_factory, build)


def greedy(model_dir, **parallel) -> list:
    from pagedllm import SamplingParams
    from tests.test_llm import make_prompts

    llm = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory=1 << 22, **parallel)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
        outputs = llm.generate([{"prompt_token_ids": p} for p in make_prompts(seed=7, lens=[5, 23, 2])], params,
                               use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outputs]


@pytest.mark.parametrize("name, parallel", [
    ("qwen2moe", dict(tensor_parallel_size=2)),
    ("qwen2moe", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("qwen3moe", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("qwen3moe", dict(pipeline_parallel_size=2)),
])
def test_whole_model_on_two_ranks_decodes_what_one_rank_does(moe_model, name, parallel):
    assert_engine_decodes_what_one_rank_does(moe_model(name), **parallel)


def assert_engine_decodes_what_one_rank_does(path, **parallel) -> None:
    """LLM with `parallel` (the worker's backend choice, check_split, per-rank KV sizing)
    decodes one rank's greedy tokens, logprobs within 1e-4."""
    one = greedy(path)
    assert all(len(set(tokens)) > 4 for tokens, _ in one), "a degenerate random model proves nothing"
    for i, ((want, want_lp), (got, got_lp)) in enumerate(zip(one, greedy(path, **parallel))):
        assert got == want, f"prompt {i}: {parallel} decoded {got}, one rank {want}"
        assert got_lp == pytest.approx(want_lp, abs=1e-4)
