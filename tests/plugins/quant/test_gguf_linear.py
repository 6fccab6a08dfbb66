"""How GGUF layers pick their small-batch kernel (plugins/quant/gguf_linear.py)."""

from __future__ import annotations

from pagedllm.ops.cpu import crossover
from pagedllm.plugins.quant import gguf_linear


def test_a_candidate_that_lost_on_this_machine_is_not_built_again(monkeypatch):
    """A warm start-up packed every candidate's weights before reading the cached contest
    that says it loses (torch's int4 packing: ~0.26 s of a ~5 s start-up on Zen 4)."""
    built = []

    class Candidate:
        def tensors(self):
            return []

    def maker(kind):
        def make(blocks, source, k):
            built.append(kind)
            return Candidate()
        return make

    monkeypatch.setattr(gguf_linear.dense_kernels, "bf16_products_allowed", lambda: True)
    monkeypatch.setattr(gguf_linear, "_SMALL_CANDIDATES", (("lost", maker("lost")), ("new", maker("new"))))
    monkeypatch.setattr(crossover, "known", lambda what, candidates: crossover.NEVER if "|lost|" in what else None)
    asked = []

    def rows_from(what, small, large, k, candidates):
        asked.append(what)
        return 1

    monkeypatch.setattr(crossover, "rows_from", rows_from)
    side, name = gguf_linear._small_rows_kernel("q4_1", "8x32", [], 32, crossover.Contender(lambda x: x), [])
    assert built == ["new"], f"built {built}: a candidate known to lose was packed again"
    assert name == "new" and asked == ["gguf-q4_1|native|new|8x32"], asked


def _gguf_embedding(serves_logits: bool, vocab: int = 48, hidden: int = 64):
    """A GGUF embedding layer holding random Q8_0 blocks, loaded and processed (keep_dense)."""
    import torch
    from torch import nn

    from pagedllm.plugins.quant.gguf_dequant import dequantize
    from pagedllm.plugins.quant.gguf_file import Q8_0
    from tests._ggml_blocks import random_blocks

    layer = nn.Module()
    layer.prefix, layer.serves_logits = "model.embed_tokens", serves_logits
    method = gguf_linear.GGUFEmbeddingMethod(keep_dense=True)
    method.create_weights(layer, vocab, hidden, torch.float32)
    raw = random_blocks(Q8_0, vocab, hidden, torch.Generator().manual_seed(0))
    layer.weight.weight_loader(layer.weight, gguf_linear.tag_raw(raw, Q8_0), None)
    method.process_after_loading(layer)
    return layer, method, dequantize(raw, Q8_0, (vocab, hidden))


def test_an_untied_input_embedding_builds_nothing_for_logits():
    """An input embedding whose model has its own lm_head (`serves_logits` False) keeps only
    the exact dense copy its lookups read: no native repacking, no packed head, no kernel
    contests (on Qwen2.5's untied 151936 x 1536 Q4_K token_embd these cost start-up seconds
    and a packed copy of the matrix for logits nobody asks for)."""
    import torch

    untied, method, exact = _gguf_embedding(serves_logits=False)
    assert untied.gguf_packed is None and untied.gguf_head is None and untied.gguf_small is None
    assert torch.equal(untied.weight, exact), "the lookups' dense copy is not the file's exact values"
    ids = torch.tensor([0, 5, 47])
    assert torch.equal(method.embed(untied, ids), exact[ids])
    tied, _, _ = _gguf_embedding(serves_logits=True)
    assert tied.gguf_head is not None, "a tied embedding lost its logits head"
