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
