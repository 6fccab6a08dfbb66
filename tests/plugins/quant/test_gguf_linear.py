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


def _q4_1_linear(monkeypatch, first: int, last: int, rows: int = 64, cols: int = 96):
    """A GGUF Q4_1 linear layer (keep_dense), processed under "medium" precision with every
    crossover faked: the small-batch kernel -> dense copy at 1 row, small -> Q4 tiles at
    `first`, Q4 tiles -> dense at `last`."""
    import torch
    from torch import nn

    from pagedllm import ops
    from pagedllm.plugins.quant.gguf_file import Q4_1
    from tests._ggml_blocks import random_blocks

    def rows_from(what, small, large, k, candidates=crossover.CANDIDATES):
        kernels = what.split("|")  # "gguf-q4_1|<small>|<large>|<shape>" or "dense-f32|amx-bf16|<shape>"
        return last if kernels[1] == "amx-q4" else first if kernels[2] == "amx-q4" else 1

    monkeypatch.setattr(crossover, "known", lambda what, candidates=crossover.CANDIDATES: None)
    monkeypatch.setattr(crossover, "rows_from", rows_from)
    layer = nn.Module()
    layer.prefix = "model.layers.0.mlp.down_proj"
    method = gguf_linear.GGUFLinearMethod(keep_dense=True)
    method.create_weights(layer, cols, [rows], torch.float32)
    raw = random_blocks(Q4_1, rows, cols, torch.Generator().manual_seed(3))
    layer.weight.weight_loader(layer.weight, gguf_linear.tag_raw(raw, Q4_1), None)
    with ops.matmul_precision("medium"):
        method.process_after_loading(layer)
    return layer, method


def _needs_amx():
    import pytest

    from pagedllm.ops.cpu import features, native
    if not native.available() or not native.amx_available() or not features.detect().native_bf16:
        pytest.skip("the Q4 tiles kernel runs on AMX tiles only")


def test_q4_tiles_serve_the_rows_between_the_small_kernel_and_the_dense_copy(monkeypatch):
    """Below `first` rows the small-batch kernel, from `first` to `last` the Q4 tiles (equal
    to the dense copy's bf16 tiles, value for value, the fused gate/up activation too), from
    `last` the dense copy; the Q4 tiles are a parameter of the layer."""
    import torch

    from pagedllm.ops.cpu import native

    _needs_amx()
    layer, method = _q4_1_linear(monkeypatch, first=4, last=32)
    assert layer.gguf_q4 is not None and layer.gguf_native_below == 4 and layer.gguf_q4_below == 32
    assert "qweight_amx_q4" in dict(layer.named_parameters())
    calls = []
    real = native.q4_tiles_linear
    def counted(x, w, out=None, silu_and_mul=False):
        calls.append(x.shape[0])
        return real(x, w, out, silu_and_mul)

    monkeypatch.setattr(native, "q4_tiles_linear", counted)
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 3, 4, 17, 31, 32, 40):
        x = torch.randn(rows, 96, generator=gen)
        got = method.apply(layer, x, None)
        if 4 <= rows < 32:
            assert torch.equal(got, layer.gguf_dense(x, None)), f"{rows} rows: Q4 tiles differ from the dense copy"
            fused = method.apply_silu_and_mul(layer, x, None)
            assert torch.equal(fused, layer.gguf_dense.silu_and_mul(x, None)), f"{rows} rows: fused Q4 tiles differ"
    assert calls == [4, 4, 17, 17, 31, 31], f"Q4 tiles served {calls}"


def test_q4_tiles_that_never_win_are_dropped(monkeypatch):
    _needs_amx()
    layer, _ = _q4_1_linear(monkeypatch, first=32, last=16)
    assert layer.gguf_q4 is None and "qweight_amx_q4" not in dict(layer.named_parameters())
    assert layer.gguf_native_below == 1, "the small kernel's crossover with the dense copy stays as measured"
