"""FLASH_ATTN and FLASHINFER metadata, built and checked on the CPU without either library.

First the index arrays alone: gathering pages through them must reproduce exactly the K/V
the TORCH reference reads for the same batch. Then each impl end to end against stand-in
modules (`flash_attn`, `flashinfer`) written here from the libraries' documented
semantics (varlen causal aligned to the end of the context, window_size / window_left,
softcap, page tables, k_scale/v_scale); they check our plumbing, not the CUDA kernels,
which test_gpu.py covers on a GPU.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from pagedllm.plugins.attention import pagedllm_attention_backends
from pagedllm.plugins.attention.flash_attn import FlashAttnBackend, build_flash_attn_metadata
from pagedllm.plugins.attention.flashinfer import FlashInferBackend, paged_kv_arrays
from pagedllm.plugins.attention.torch_ref import TorchBackend

REQUESTS = [(0, 1), (37, 1), (0, 20), (40, 9), (100, 1), (15, 2)]


def reference_view(cache: torch.Tensor, layout, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of request i as the reference reads them from a [2, blocks, ...] cache."""
    seq_len = int(layout.seq_lens_cpu[i])
    blocks = layout.block_tables[i, : -(-seq_len // layout.block_size)].long()
    return cache[0][blocks].flatten(0, 1)[:seq_len], cache[1][blocks].flatten(0, 1)[:seq_len]


# --------------------------------------------------------------------------- index arrays


@pytest.mark.parametrize("block_size", [16, 32])
def test_flashinfer_pages_gather_the_reference_kv(make_paged_batch, block_size):
    batch = make_paged_batch(REQUESTS, block_size=block_size, num_kv_heads=2)
    layout = batch.layout
    paged = batch.kv_cache.transpose(0, 1).contiguous()  # FlashInfer NHD: [blocks, 2, page, heads, dim]
    assert FlashInferBackend.kv_cache_shape(*batch.kv_cache.shape[1:]) == paged.shape
    group = [5, 1, 2, 0]  # any subset, any order
    arrays = paged_kv_arrays(layout, group)
    assert arrays.indptr.dtype == arrays.indices.dtype == arrays.last_page_len.dtype == torch.int32
    for j, i in enumerate(group):
        pages = arrays.indices[arrays.indptr[j]: arrays.indptr[j + 1]].long()
        last = int(arrays.last_page_len[j])
        assert 1 <= last <= block_size
        kv_len = (len(pages) - 1) * block_size + last
        k_ref, v_ref = reference_view(batch.kv_cache, layout, i)
        assert torch.equal(paged[pages, 0].flatten(0, 1)[:kv_len], k_ref)
        assert torch.equal(paged[pages, 1].flatten(0, 1)[:kv_len], v_ref)
        start, end = int(layout.query_start_loc_cpu[i]), int(layout.query_start_loc_cpu[i + 1])
        rows = arrays.rows[arrays.qo_indptr[j]: arrays.qo_indptr[j + 1]]
        assert rows.tolist() == list(range(start, end))


def test_flash_attn_tables_gather_the_reference_kv(make_paged_batch):
    batch = make_paged_batch(REQUESTS, block_size=16)
    md = build_flash_attn_metadata(batch.layout)
    assert md.cu_seqlens_q.tolist() == batch.layout.query_start_loc_cpu.tolist()
    assert not md.is_pure_decode and md.max_seq_len == 101
    assert md.block_table.shape[1] == 7  # trimmed to the longest context's blocks
    k_cache, v_cache = batch.kv_cache[0], batch.kv_cache[1]  # flash-attn's paged k_cache / v_cache
    for i in range(len(REQUESTS)):
        kv_len = int(md.cu_seqlens_k[i + 1] - md.cu_seqlens_k[i])
        blocks = md.block_table[i, : -(-kv_len // 16)].long()
        k_ref, v_ref = reference_view(batch.kv_cache, batch.layout, i)
        assert torch.equal(k_cache[blocks].flatten(0, 1)[:kv_len], k_ref)
        assert torch.equal(v_cache[blocks].flatten(0, 1)[:kv_len], v_ref)


# --------------------------------------------------------------------------- stand-in libraries


def attend(q, k, v, scale, window_left, soft_cap):
    """q [n, H, D] against k/v [L, KVH, D]; causal aligned to the end (query j is at L - n + j)."""
    n, num_heads, _ = q.shape
    length, num_kv_heads = k.shape[:2]
    k = k.float().repeat_interleave(num_heads // num_kv_heads, 1)
    v = v.float().repeat_interleave(num_heads // num_kv_heads, 1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if soft_cap:
        s = soft_cap * torch.tanh(s / soft_cap)
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    mask = k_pos <= q_pos
    if window_left >= 0:
        mask &= k_pos >= q_pos - window_left
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("hnl,lhd->nhd", p, v).to(q.dtype)


def fake_flash_attn() -> types.ModuleType:
    def gather(cache, table, length):
        if cache.shape[1] % 256:
            raise RuntimeError("Paged KV cache block size must be divisible by 256")
        return cache[table[: -(-length // cache.shape[1])].long()].flatten(0, 1)[:length]

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        if not causal or window_size[1] not in (0, -1):
            raise AssertionError("expected causal attention")
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            length = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
            keys, values = gather(k, block_table[i], length), gather(v, block_table[i], length)
            out[qs:qe] = attend(q[qs:qe], keys, values, softmax_scale, window_size[0], softcap)
        return out

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, **_):
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            length = int(cache_seqlens[i])
            keys, values = gather(k_cache, block_table[i], length), gather(v_cache, block_table[i], length)
            out[i] = attend(q[i], keys, values, softmax_scale, window_size[0], softcap)
        return out

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def fake_flashinfer(plan_log: list) -> types.ModuleType:
    class Wrapper:
        def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False):
            if kv_layout != "NHD":
                raise AssertionError(kv_layout)

        def _plan(self, qo_indptr, indptr, indices, last_page_len, page_size, options):
            plan_log.append((type(self).__name__, options["sm_scale"], options["window_left"]))
            self.arrays = (qo_indptr, indptr, indices, last_page_len, page_size)
            self.options = options

        def run(self, q, kv_cache, k_scale=None, v_scale=None):
            qo_indptr, indptr, indices, last_page_len, page_size = self.arrays
            o = self.options
            out = torch.empty_like(q)
            for i in range(len(indptr) - 1):
                pages = indices[indptr[i]: indptr[i + 1]].long()
                length = (len(pages) - 1) * page_size + int(last_page_len[i])
                keys = kv_cache[pages, 0].flatten(0, 1)[:length].float() * (k_scale or 1.0)
                values = kv_cache[pages, 1].flatten(0, 1)[:length].float() * (v_scale or 1.0)
                qs, qe = int(qo_indptr[i]), int(qo_indptr[i + 1])
                out[qs:qe] = attend(q[qs:qe], keys.to(q.dtype), values.to(q.dtype), o["sm_scale"],
                                    o["window_left"], o["logits_soft_cap"] or 0.0)
            return out

    class BatchDecodeWithPagedKVCacheWrapper(Wrapper):
        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **options):
            self._plan(torch.arange(len(indptr)), indptr, indices, last_page_len, page_size, options)

    class BatchPrefillWithPagedKVCacheWrapper(Wrapper):
        def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 causal=False, **options):
            if not causal:
                raise AssertionError("expected causal attention")
            self._plan(qo_indptr, indptr, indices, last_page_len, page_size, options)

    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    return module


def run_reference(batch, window, soft_cap, k_scale=1.0, v_scale=1.0):
    """(output, cache after the write) of the TORCH reference on a copy of the batch's cache."""
    cache = batch.kv_cache.clone()
    impl = TorchBackend.impl_cls()(batch.spec, batch.scale, window, soft_cap)
    impl.k_scale, impl.v_scale = k_scale, v_scale
    metadata = TorchBackend.builder_cls()(batch.spec).build(batch.layout)
    return impl.forward(batch.q, batch.k, batch.v, cache, metadata), cache


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


ATTENTION_CASES = {
    "mixed": (REQUESTS, None, None),
    "pure-decode": ([(300, 1), (5, 1), (64, 1)], None, None),
    "pure-prefill": ([(0, 20), (33, 17)], None, None),
    "window-and-cap": (REQUESTS, 24, 5.0),
}


@pytest.mark.parametrize("requests, window, soft_cap", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_flashinfer_impl_plumbing(make_paged_batch, monkeypatch, requests, window, soft_cap, kv_cache_dtype):
    plans: list = []
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(plans))
    batch = make_paged_batch(requests, num_heads=8, num_kv_heads=2, kv_cache_dtype=kv_cache_dtype)
    scales = dict(k_scale=0.5, v_scale=2.0) if kv_cache_dtype == "fp8" else dict(k_scale=1.0, v_scale=1.0)
    expected, expected_cache = run_reference(batch, window, soft_cap, **scales)

    metadata = FlashInferBackend.builder_cls()(batch.spec).build(batch.layout)
    planned_by_builder = len(plans)
    assert planned_by_builder in (1, 2)  # decode and/or prefill wrapper, once for the step
    impl = FlashInferBackend.impl_cls()(batch.spec, batch.scale, window, soft_cap)
    impl.k_scale, impl.v_scale = scales["k_scale"], scales["v_scale"]
    for _layer in range(3):  # every layer reuses the step's plan; a windowed layer plans once more
        cache = batch.kv_cache.transpose(0, 1).contiguous()  # FlashInfer's [blocks, 2, ...] layout
        out = impl.forward(batch.q, batch.k, batch.v, cache, metadata)
    assert len(plans) == planned_by_builder * (1 if window is None else 2)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(raw_bytes(cache.transpose(0, 1)), raw_bytes(expected_cache))


@pytest.mark.parametrize("requests, window, soft_cap", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_flash_attn_impl_plumbing(make_paged_batch, monkeypatch, requests, window, soft_cap):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    batch = make_paged_batch(requests, num_heads=8, num_kv_heads=2, block_size=256)
    expected, expected_cache = run_reference(batch, window, soft_cap)
    cache = batch.kv_cache.clone()
    metadata = FlashAttnBackend.builder_cls()(batch.spec).build(batch.layout)
    impl = FlashAttnBackend.impl_cls()(batch.spec, batch.scale, window, soft_cap)
    out = impl.forward(batch.q, batch.k, batch.v, cache, metadata)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(cache, expected_cache)


# --------------------------------------------------------------------------- checks and registration


def test_backends_register_without_their_libraries():
    backends = pagedllm_attention_backends()
    assert set(backends) == {"TORCH", "CPU_ATTN", "TRITON", "FLASH_ATTN", "FLASHINFER"}
    assert backends["FLASH_ATTN"].priority["cuda"] > backends["FLASHINFER"].priority["cuda"] \
        > backends["TRITON"].priority["cuda"] > backends["TORCH"].priority["cuda"]
    for library in ("flash_attn", "flashinfer"):
        assert library not in sys.modules, f"registration imported {library}"


def test_checks_say_what_to_do(make_paged_batch):
    spec = make_paged_batch([(0, 2)], dtype=torch.float16).spec
    fa = FlashAttnBackend.check(spec)
    fi = FlashInferBackend.check(spec)
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash_attn is not installed (pip install pagedllm[flash-attn])" in fa
    if importlib.util.find_spec("flashinfer") is None:
        assert "flashinfer is not installed (pip install pagedllm[flashinfer])" in fi
    assert any("block_size=16" in r and "--block-size 256" in r for r in fa)
    fp8 = make_paged_batch([(0, 2)], dtype=torch.float16, kv_cache_dtype="fp8").spec
    assert any("FP8" in r for r in FlashAttnBackend.check(fp8))
    assert not any("kv_cache_dtype" in r for r in FlashInferBackend.check(fp8))
    if not torch.cuda.is_available():
        assert any("CUDA" in r for r in fa) and any("CUDA" in r for r in fi)
