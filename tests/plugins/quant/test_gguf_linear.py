"""How GGUF layers pick their small-batch kernel (plugins/quant/gguf_linear.py)."""

from __future__ import annotations

import pytest

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

    monkeypatch.setattr(gguf_linear, "_may_round_blocks", lambda: True)
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


def _fake_tile_crossovers(monkeypatch, first: int, last: int, asked: list | None = None) -> None:
    """Every crossover faked: the small-batch kernel -> dense copy at 1 row, small -> tiles at
    `first`, tiles -> dense at `last` (the contests' names go to `asked`)."""
    def rows_from(what, small, large, k, candidates=crossover.CANDIDATES):
        if asked is not None:
            asked.append(what)
        kernels = what.split("|")  # "gguf-q4_1|<small>|<large>|<shape>" or "dense-f32|amx-bf16|<shape>"
        return last if kernels[1].startswith("amx-q") else first if kernels[2].startswith("amx-q") else 1

    monkeypatch.setattr(crossover, "known", lambda what, candidates=crossover.CANDIDATES: None)
    monkeypatch.setattr(crossover, "rows_from", rows_from)


def _q4_1_linear(monkeypatch, first: int, last: int, rows: int = 64, cols: int = 96, qtype: int | None = None,
                 contests=None):
    """A GGUF linear layer of Q4_1 (or `qtype`) blocks (keep_dense), processed under "medium"
    precision with every crossover faked (`_fake_tile_crossovers`, or `contests` in place of
    its `rows_from`)."""
    import torch
    from torch import nn

    from pagedllm import ops
    from pagedllm.plugins.quant.gguf_file import Q4_1
    from tests._ggml_blocks import random_blocks

    qtype = Q4_1 if qtype is None else qtype
    _fake_tile_crossovers(monkeypatch, first, last)
    if contests is not None:
        monkeypatch.setattr(crossover, "rows_from", contests)
    layer = nn.Module()
    layer.prefix = "model.layers.0.mlp.down_proj"
    method = gguf_linear.GGUFLinearMethod(keep_dense=True)
    method.create_weights(layer, cols, [rows], torch.float32)
    raw = random_blocks(qtype, rows, cols, torch.Generator().manual_seed(3))
    layer.weight.weight_loader(layer.weight, gguf_linear.tag_raw(raw, qtype), None)
    with ops.matmul_precision("medium"):
        method.process_after_loading(layer)
    return layer, method


def _needs_amx():
    import pytest

    from pagedllm.ops.cpu import features, native
    if not native.available() or not native.amx_available() or not features.detect().native_bf16:
        pytest.skip("the quantized tiles kernel runs on AMX tiles only")


@pytest.mark.parametrize("qtype_name", ["Q4_1", "Q4_0", "Q8_0"])
def test_quant_tiles_serve_the_rows_between_the_small_kernel_and_the_dense_copy(monkeypatch, qtype_name):
    """Below `first` rows the small-batch kernel, from `first` to `last` the quantized tiles
    (equal to the dense copy's bf16 tiles, value for value, the fused gate/up activation too),
    from `last` the dense copy; the tiles are a parameter of the layer."""
    import torch

    from pagedllm.ops.cpu import native
    from pagedllm.plugins.quant import gguf_file

    _needs_amx()
    layer, method = _q4_1_linear(monkeypatch, first=4, last=32, qtype=getattr(gguf_file, qtype_name))
    assert layer.gguf_tiles is not None and layer.gguf_native_below == 4 and layer.gguf_tiles_below == 32
    assert "qweight_amx_tiles" in dict(layer.named_parameters())
    calls = []
    real = native.quant_tiles_linear
    def counted(x, w, out=None, silu_and_mul=False):
        calls.append(x.shape[0])
        return real(x, w, out, silu_and_mul)

    monkeypatch.setattr(native, "quant_tiles_linear", counted)
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 3, 4, 17, 31, 32, 40):
        x = torch.randn(rows, 96, generator=gen)
        got = method.apply(layer, x, None)
        if 4 <= rows < 32:
            assert torch.equal(got, layer.gguf_dense(x, None)), f"{rows} rows: the tiles differ from the dense copy"
            fused = method.apply_silu_and_mul(layer, x, None)
            assert torch.equal(fused, layer.gguf_dense.silu_and_mul(x, None)), f"{rows} rows: fused tiles differ"
    assert calls == [4, 4, 17, 17, 31, 31], f"the tiles served {calls}"


def test_quant_tiles_that_never_win_are_dropped(monkeypatch):
    _needs_amx()
    layer, _ = _q4_1_linear(monkeypatch, first=32, last=16)
    assert layer.gguf_tiles is None and "qweight_amx_tiles" not in dict(layer.named_parameters())
    assert layer.gguf_native_below == 1, "the small kernel's crossover with the dense copy stays as measured"


def test_q8_0_head_logits_come_from_the_tiles_in_their_range(monkeypatch):
    """A tied Q8_0 embedding's logits (SmolLM2's head): the small-batch kernel below `first`
    rows, the Q8_0 tiles (contests named amx-q8, values equal to the dense head's bf16 tiles)
    up to `last`, the dense head above."""
    import torch

    from pagedllm import ops

    _needs_amx()
    asked = []
    _fake_tile_crossovers(monkeypatch, first=4, last=32, asked=asked)
    with ops.matmul_precision("medium"):
        head, method, _ = _gguf_embedding(serves_logits=True, vocab=96, hidden=64)
    assert head.gguf_tiles is not None and head.gguf_native_below == 4 and head.gguf_tiles_below == 32
    assert any("|amx-q8|" in what for what in asked), asked
    gen = torch.Generator().manual_seed(8)
    for rows in (2, 4, 20, 32):
        x = torch.randn(rows, 64, generator=gen)
        got = method.logits(head, x)
        assert got.shape == (rows, 96)
        if 4 <= rows < 32:
            assert torch.equal(got, head.gguf_head(x, None)), f"{rows} rows: the Q8_0 tiles differ from the dense head"


def test_the_native_repacking_is_made_only_for_the_native_kernel(monkeypatch):
    """A layer with a float32 dense copy repacks its blocks for the native kernel only when that
    kernel runs or is chosen: where a small-batch kernel wins (faked here), nothing is packed for
    it; where the native kernel wins, it is packed and serves the small batches."""
    import torch

    from pagedllm.ops.cpu import native
    from pagedllm.plugins.quant import gguf_vnni

    if not native.available() or not gguf_vnni.available():
        pytest.skip("needs the native kernels and the VNNI kernel (the candidate that wins here)")
    packs = []
    real_pack = native.pack
    monkeypatch.setattr(native, "pack", lambda *a, **k: packs.append(a[1]) or real_pack(*a, **k))
    layer, _ = _q4_1_linear(monkeypatch, first=64, last=32)  # every contest faked: VNNI wins from row 1
    assert layer.gguf_small is not None and not layer.gguf_packed and packs == [], \
        f"the native kernel lost, yet its repacking was made ({packs})"

    def native_wins(what, small, large, k, candidates=crossover.CANDIDATES):  # ... and serves up to 16 rows
        return crossover.NEVER if "|native|" in what else 16

    layer, method = _q4_1_linear(monkeypatch, first=64, last=32, contests=native_wins)
    assert layer.gguf_small is None and len(layer.gguf_packed) == 1 and packs == [3]
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(5))
    expected = native.linear(x, layer.gguf_packed[0][0])
    assert torch.equal(method.apply(layer, x, None), expected), "one row is not the native kernel's"
