"""Tensor parallelism in the Llama family: the same tiny checkpoints on 2 (and 4) gloo
ranks give the logits of one rank (float32, atol 1e-4) and the same greedy tokens over a
prefill and 8 decode steps, on every rank. Cases: KV heads split (2 over 2 ranks) and
replicated (1 over 2, 2 over 4), biases on q/k/v and o (column-split, and added once after
the row-parallel sum), Qwen3's per-head q/k norm with tied embeddings, vocabularies that
do not divide (509 over 2 and 4: the last rank's part padded). Below them, the layers'
part of each checkpoint tensor on a given rank, and the refusal of a quantized method
under tp > 1."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.parallel import Group, ParallelLayout, ParallelState
from pagedllm.plugins.models.layers import Linear, VocabEmbedding, load_shard
from tests._distributed import run_ranks
from tests._rank_model import fake_state, generate, generate_all, model_context
from tests.conftest import build_tiny_model

CASES = {
    # 4 query heads, 2 KV heads: each rank one KV head of its own; tied embeddings
    "llama-kv2": ("llama", {}),
    # 1 KV head on both ranks; q/k/v and o biases; untied head; vocab 509 (255 + 254 rows)
    "llama-kv1-bias-509": ("llama", dict(num_key_value_heads=1, attention_bias=True, vocab_size=509,
                                         tie_word_embeddings=False)),
    # per-head q/k RMSNorm on the rank's heads, tied embeddings (vocab-parallel logits)
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
}
TP4 = ("llama-kv2-509", ("llama", dict(vocab_size=509)))  # 2 KV heads on 4 ranks: each held by 2


def randomize_biases(path) -> None:
    """transformers initialises biases to zero, which would hide a bias added on every rank
    before the row-parallel sum: give them random values (the reference reads them too)."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    g = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.3
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, (arch, kw) in [*CASES.items(), TP4]:
        path = build_tiny_model(tmp_path_factory.mktemp(name), arch, **kw)
        randomize_biases(path)
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def one_rank(checkpoints) -> dict[str, dict]:
    return {name: generate(ParallelState.single(), path) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def two_ranks(checkpoints) -> dict[str, list[dict]]:
    names = list(CASES)
    per_rank = run_ranks(generate_all, ParallelLayout(2, 1), [checkpoints[n] for n in names])
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(names)}


def assert_same_as_one_rank(ranks: list[dict], ref: dict) -> None:
    assert all(len(set(seq)) > 3 for seq in ref["tokens"]), "a degenerate reference proves nothing"
    for rank, got in enumerate(ranks):
        assert got["tokens"] == ref["tokens"], f"rank {rank}"
        assert got["logits"].shape == ref["logits"].shape
        torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-4, rtol=0, msg=f"rank {rank}")


@pytest.mark.parametrize("name", [*CASES, TP4[0]])
def test_the_one_rank_reference_is_transformers_greedy(name, checkpoints, one_rank):
    """Anchors the reference (the biased case also checks o_proj's bias follows
    attention_bias, as in transformers' Llama)."""
    from tests._rank_model import PROMPTS, STEPS
    from tests.test_llm import hf_greedy

    ref = one_rank[name]
    for i, (tokens, rows) in enumerate(hf_greedy(checkpoints[name], PROMPTS, STEPS + 1)):
        assert ref["tokens"][i] == tokens
        torch.testing.assert_close(torch.log_softmax(ref["logits"][:, i], -1), torch.stack(rows), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_give_one_ranks_logits_and_tokens(name, two_ranks, one_rank):
    assert_same_as_one_rank(two_ranks[name], one_rank[name])


def test_four_ranks_share_each_kv_head_between_two(checkpoints, one_rank):
    name = TP4[0]
    ranks = run_ranks(generate, ParallelLayout(4, 1), checkpoints[name])
    assert_same_as_one_rank(ranks, one_rank[name])


# ---------------------------------------------------------------- layers on one rank

def rank_of(rank: int, size: int = 2) -> Group:
    """A group's view from `rank` (building and loading call no collective)."""
    return Group(list(range(size)), rank)


def test_column_layer_holds_its_rows_of_each_shard_and_replicates_a_kv_head():
    # q: 4 heads of 2 rows over 4 ranks; k, v: 2 heads (parts) over 4 ranks -> rank 3 holds head 1
    q, k, v = (torch.arange(n * 3, dtype=torch.float32).view(n, 3) + off for n, off in ((8, 0), (4, 100), (4, 200)))
    bq, bk, bv = (torch.arange(n, dtype=torch.float32) + off for n, off in ((8, 0), (4, 100), (4, 200)))
    layer = Linear(3, [8, 4, 4], bias=True, parallel="column", tp=rank_of(3, 4), output_parts=[4, 2, 2])
    assert layer.output_sizes == [2, 2, 2] and layer.input_size == 3
    for shard, (w, b) in enumerate(((q, bq), (k, bk), (v, bv))):
        load_shard(layer.weight, w, shard)
        load_shard(layer.bias, b, shard)
    assert torch.equal(layer.weight, torch.cat([q[6:8], k[2:4], v[2:4]]))
    assert torch.equal(layer.bias, torch.cat([bq[6:8], bk[2:4], bv[2:4]]))


def test_row_layer_holds_its_input_columns_and_adds_the_bias_once():
    w, b = torch.randn(5, 6), torch.randn(5)
    layer = Linear(6, 5, bias=True, parallel="row", tp=rank_of(1))
    load_shard(layer.weight, w, None)
    load_shard(layer.bias, b, None)
    assert torch.equal(layer.weight, w[:, 3:]) and torch.equal(layer.bias, b)
    # the sum over the group is the full product (simulated: rank 0's part plus this one's)
    rank0 = Linear(6, 5, bias=True, parallel="row", tp=rank_of(0))
    load_shard(rank0.weight, w, None)
    x = torch.randn(2, 6)
    partial = rank0.method.apply(rank0, x[:, :3], None) + layer.method.apply(layer, x[:, 3:], None)
    torch.testing.assert_close(partial + layer.bias, x @ w.T + b)


def test_a_checkpoint_of_the_wrong_size_or_a_fused_tensor_is_refused():
    layer = Linear(4, [4, 4], parallel="column", tp=rank_of(1))
    with pytest.raises(ValueError, match="expected 4 rows"):
        load_shard(layer.weight, torch.zeros(6, 4), 0)
    with pytest.raises(ValueError, match="separately"):
        load_shard(layer.weight, torch.zeros(8, 4), None)
    with pytest.raises(ValueError, match="cannot be cut into 2 equal parts"):
        Linear(4, [3], parallel="column", tp=rank_of(0))


def test_one_rank_layers_are_unsplit():
    layer = Linear(6, [4, 2], bias=True, parallel="column")
    assert layer.parallel is None and not hasattr(layer.weight, "tp_dim")
    w = torch.randn(4, 6)
    load_shard(layer.weight, w, 0)
    assert torch.equal(layer.weight[:4], w)


def test_vocab_parts_are_equal_with_the_last_padded():
    table = torch.randn(509, 4)
    last = VocabEmbedding(509, 4, torch.float32, tp=rank_of(1))
    assert (last.vocab_start, last.vocab_end, last.weight.shape[0]) == (255, 509, 255)
    load_shard(last.weight, table, None)
    assert torch.equal(last.weight[:254], table[255:]) and torch.equal(last.weight[254], torch.zeros(4))
    first = VocabEmbedding(509, 4, torch.float32, tp=rank_of(0))
    load_shard(first.weight, table, None)
    assert torch.equal(first.weight, table[:255])


def test_a_quantized_method_is_refused_under_tensor_parallel():
    import transformers

    from pagedllm.plugins.models.llama import LlamaForCausalLM
    from pagedllm.plugins.quant.awq import AWQConfig

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    quant = AWQConfig.from_config({"bits": 4, "group_size": 16}, {})
    quant.bind(LlamaForCausalLM.packed_modules_mapping)
    LlamaForCausalLM(model_context(cfg, ParallelState.single(), quant))  # one rank: fine
    with pytest.raises(NotImplementedError, match=r"quantization awq with tensor_parallel_size > 1 is not "
                                                  r"supported yet"):
        LlamaForCausalLM(model_context(cfg, fake_state(2, 1, 0), quant))


def test_an_untied_input_embedding_has_no_head_and_refuses_logits():
    """Unquantized too: an input embedding built with serves_logits=False packs no head (a
    copy of the whole matrix) and says so if logits are asked of it."""
    untied = VocabEmbedding(32, 16, torch.float32, prefix="model.embed_tokens", serves_logits=False)
    untied.method.process_after_loading(untied)
    assert "head" not in untied.__dict__
    with pytest.raises(RuntimeError, match="model.embed_tokens: built as an input embedding only"):
        untied.logits(torch.randn(2, 16))
    tied = VocabEmbedding(32, 16, torch.float32, prefix="lm_head")
    tied.method.process_after_loading(tied)
    assert tied.logits(torch.randn(2, 16)).shape == (2, 32)
