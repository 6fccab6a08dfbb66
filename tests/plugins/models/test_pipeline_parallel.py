"""Pipeline parallelism in the Llama family: two stages (gloo ranks) handing each other the
hidden state and residual give one rank's logits and greedy tokens over a prefill and 8
decode steps; also with tied embeddings (the last stage loads its own copy of the
embedding as its head), an uneven split (3 layers: 1 + 2), and with 2 x 2 ranks
(tensor-parallel stages). Below them, what each stage holds and loads."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.parallel import ParallelLayout, ParallelState
from pagedllm.plugins.models.llama import AbsentLayer
from tests._distributed import run_ranks
from tests._rank_model import build_model, fake_state, generate, generate_all, load_model
from tests.conftest import build_tiny_model

CASES = {
    # tied embeddings across stages, 3 layers (stage 0: layer 0; stage 1: layers 1, 2), odd vocab
    "llama-tied-3": ("llama", dict(num_hidden_layers=3, vocab_size=509)),
    # untied head, per-head q/k norm
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: str(build_tiny_model(tmp_path_factory.mktemp(name), arch, **kw)) for name, (arch, kw) in CASES.items()}


@pytest.fixture(scope="module")
def one_rank(checkpoints) -> dict[str, dict]:
    return {name: generate(ParallelState.single(), path) for name, path in checkpoints.items()}


def assert_same_as_one_rank(ranks: list[dict], ref: dict, last: list[int]) -> None:
    """Every rank got the reference tokens; the last stage's ranks (`last`) its logits."""
    assert all(len(set(seq)) > 3 for seq in ref["tokens"]), "a degenerate reference proves nothing"
    for rank, got in enumerate(ranks):
        assert got["tokens"] == ref["tokens"], f"rank {rank}"
        assert ("logits" in got) == (rank in last), f"rank {rank}"
        if rank in last:
            torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-4, rtol=0, msg=f"rank {rank}")


def test_two_stages_give_one_ranks_logits_and_tokens(checkpoints, one_rank):
    names = list(CASES)
    per_rank = run_ranks(generate_all, ParallelLayout(1, 2), [checkpoints[n] for n in names])
    for i, name in enumerate(names):
        assert_same_as_one_rank([rank[i] for rank in per_rank], one_rank[name], last=[1])


def test_two_tensor_parallel_stages(checkpoints, one_rank):
    name = "llama-tied-3"
    ranks = run_ranks(generate, ParallelLayout(2, 2), checkpoints[name])
    assert_same_as_one_rank(ranks, one_rank[name], last=[2, 3])


# ---------------------------------------------------------------- what a stage holds

def held(model: torch.nn.Module) -> set[str]:
    """Module names (up to the decoder layer) that own parameters."""
    return {".".join(n.split(".")[:3]) if n.startswith("model.layers.") else n.rsplit(".", 1)[0]
            for n, _ in model.named_parameters()}


def test_each_stage_holds_and_loads_only_its_part(checkpoints):
    first = load_model(fake_state(1, 2, 0), checkpoints["llama-tied-3"])
    last = load_model(fake_state(1, 2, 1), checkpoints["llama-tied-3"])
    assert held(first) == {"model.embed_tokens", "model.layers.0"}
    assert held(last) == {"model.layers.1", "model.layers.2", "model.norm", "lm_head"}
    assert isinstance(first.model.layers[1], AbsentLayer) and isinstance(last.model.layers[0], AbsentLayer)
    # the last stage's head is a copy of the tied embedding
    whole = load_model(ParallelState.single(), checkpoints["llama-tied-3"])
    assert torch.equal(last.lm_head.weight, whole.model.embed_tokens.weight)
    with pytest.raises(RuntimeError, match="only the last pipeline stage"):
        first.compute_logits(torch.zeros(1, 64))


def test_a_stage_misses_only_its_own_tensors(checkpoints):
    stage0, source = build_model(fake_state(1, 2, 0), checkpoints["qwen3"])
    without = {k: v for k, v in source.weights() if k != "model.layers.1.mlp.down_proj.weight"}
    loaded = stage0.load_weights(iter(without.items()))  # layer 1 is not its own
    assert loaded == set(dict(stage0.named_parameters())) and not any(n.startswith("model.layers.1.") for n in loaded)
    stage1, _ = build_model(fake_state(1, 2, 1), checkpoints["qwen3"])
    with pytest.raises(ValueError, match=r"missing weights for: \['model.layers.1.mlp.down_proj.weight'\]"):
        stage1.load_weights(iter(without.items()))


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_inner_hidden_states_are_refused_on_several_ranks(checkpoints, tp, pp):
    model = load_model(fake_state(tp, pp, 0), checkpoints["qwen3"])
    with pytest.raises(NotImplementedError, match="EAGLE-3"):
        model.set_aux_hidden_state_layers((0, 1))
    model.set_aux_hidden_state_layers(())  # asking for none is fine
