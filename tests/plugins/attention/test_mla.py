"""MLA (multi-head latent attention) on the TORCH and TRITON backends vs a dense reference.

An "mla" spec caches one latent of `latent_size` elements per token; every query head
attends with its [latent_size] query to the whole latents (keys) and takes their first
`value_size` elements as values. The reference below is that formula written out per
request and query token, over the full (cached + new) latents in float64: it checks the
paged write, the block-table reads of cached context, causal masking inside prefill
chunks and the split of keys into value part and tail. TRITON runs interpreted on the
CPU, so cases stay tiny; one case uses DeepSeek's real sizes (512 + 64) with more heads
than one decode tile holds. On a CUDA machine (marker `cuda`, scripts/gpu_check.sh) the
compiled kernels run DeepSeek-V3's shape (128 heads) in fp16/bf16 and with an FP8 cache.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, build_layout, layout_to
from pagedllm.core.contracts import AttentionSpec, kv_cache_torch_dtype
from pagedllm.core.plugins import get_registry
from pagedllm.plugins.attention.torch_ref import TorchBackend
from pagedllm.plugins.attention.triton_backend import TritonBackend


def mla_spec(num_heads: int, value_size: int, rope_size: int, dtype=torch.float32, kv_cache_dtype="auto",
             block_size: int = 16, device=DEVICE) -> AttentionSpec:
    return AttentionSpec(num_heads=num_heads, num_kv_heads=1, head_size=value_size + rope_size, dtype=dtype,
                         kv_cache_dtype=kv_cache_dtype, block_size=block_size, device=device, kind="mla",
                         value_size=value_size)


class MlaBatch:
    """One step: requests of (cached, new) tokens on shuffled blocks, every token's latent
    (`latents[i]`: request i's [seq_len, D], the cached ones already in `cache`), and q."""

    def __init__(self, requests, num_heads, value_size, rope_size, *, block_size=16, kv_cache_dtype="auto",
                 k_scale=1.0, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.spec = mla_spec(num_heads, value_size, rope_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                             block_size=block_size)
        size = value_size + rope_size
        num_blocks = sum(-(-(c + n) // block_size) for c, n in requests) + 2
        self.layout = build_layout(requests, block_size, num_blocks, gen)
        self.requests, self.k_scale = requests, k_scale
        cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
        # stale values in every slot: a kernel reading a slot it should not would show
        self.cache = torch.randn(num_blocks, block_size, size, generator=gen).to(cache_dtype)
        self.latents, new = [], []
        for i, (cached, fresh) in enumerate(requests):
            lat = torch.randn(cached + fresh, size, generator=gen)
            table = self.layout.block_tables[i].long()
            pos = torch.arange(cached)
            self.cache[table[pos // block_size], pos % block_size] = (lat[:cached] / k_scale).to(cache_dtype)
            self.latents.append(lat)
            new.append(lat[cached:])
        self.k = torch.cat(new)[:, None, :].to(dtype)  # [T, 1, D]
        self.q = torch.randn(self.layout.num_tokens, num_heads, size, generator=gen).to(dtype)
        self.scale = 0.7 * size ** -0.5

    def reference(self) -> torch.Tensor:
        """softmax(q . latent * scale) @ latent[:value_size], per token, over its visible latents
        (as the cache holds them: rounded to an FP8 cache's grid when it is one)."""
        value_size = self.spec.out_head_size
        out, row = [], 0
        for (cached, fresh), lat in zip(self.requests, self.latents):
            if self.cache.dtype != torch.float32:
                lat = (lat / self.k_scale).to(self.cache.dtype).double() * self.k_scale
            lat = lat.double()
            for t in range(fresh):
                visible = lat[: cached + t + 1]
                scores = self.q[row].double() @ visible.T * self.scale  # [H, ctx]
                out.append(torch.softmax(scores, -1) @ visible[:, :value_size])
                row += 1
        return torch.stack(out)

    def run(self, backend) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache.clone().to(DEVICE)
        layout = layout_to(self.layout, DEVICE)
        metadata = backend.builder_cls()(self.spec).build(layout)
        impl = backend.impl_cls()(self.spec, self.scale)
        impl.k_scale = self.k_scale
        out = impl.forward(self.q.to(DEVICE), self.k.to(DEVICE), None, cache, metadata)
        return out.cpu(), cache.cpu()


CASES = {
    # (requests as (cached, new)), heads, value size (kv_lora_rank), rope size
    "decodes-and-chunks": ([(0, 1), (37, 1), (0, 20), (21, 9)], 4, 32, 16),
    "one-head-chunk-at-block-edge": ([(16, 16), (5, 1)], 1, 32, 16),
    "odd-heads-long-decode": ([(300, 1), (3, 4)], 3, 32, 16),
    "deepseek-sizes-split-heads": ([(40, 1), (7, 5)], 20, 512, 64),
}


@pytest.fixture(autouse=True)
def triton_runs_here():
    reasons = TritonBackend.check(mla_spec(4, 32, 16))
    if reasons:
        pytest.fail(f"TRITON cannot run in this test process: {'; '.join(reasons)}")


@pytest.mark.parametrize("backend", [TorchBackend, TritonBackend], ids=["TORCH", "TRITON"])
@pytest.mark.parametrize("requests, heads, value_size, rope_size", CASES.values(), ids=CASES.keys())
def test_mla_matches_dense_reference(backend, requests, heads, value_size, rope_size):
    batch = MlaBatch(requests, heads, value_size, rope_size)
    out, cache = batch.run(backend)
    assert out.shape == (batch.layout.num_tokens, heads, value_size)
    torch.testing.assert_close(out.double(), batch.reference(), atol=2e-5, rtol=2e-5)
    # the write: every new token's latent at its slot, nothing else touched
    expected = batch.cache.clone().view(-1, batch.cache.shape[-1])
    expected[batch.layout.slot_mapping] = batch.k[:, 0]
    assert torch.equal(cache.view(-1, cache.shape[-1]), expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, kv_cache_dtype", [(torch.float16, "auto"), (torch.bfloat16, "auto"),
                                                   (torch.bfloat16, "fp8")], ids=["fp16", "bf16", "bf16-fp8"])
def test_mla_compiled_matches_torch_at_deepseek_v3_sizes(dtype, kv_cache_dtype):
    """TRITON's compiled kernels at V3's shape: 128 heads on one latent of 512 + 64 (decode
    head blocks, the smaller tiles of large keys, several decode partitions)."""
    batch = MlaBatch([(1500, 1), (37, 1), (0, 200), (300, 45), (700, 1)], 128, 512, 64, dtype=dtype,
                     kv_cache_dtype=kv_cache_dtype, k_scale=0.5 if kv_cache_dtype == "fp8" else 1.0)
    out, cache = batch.run(TritonBackend)
    ref_out, ref_cache = batch.run(TorchBackend)
    raw = (lambda t: t.view(torch.uint8)) if cache.element_size() == 1 else (lambda t: t)
    assert torch.equal(raw(cache), raw(ref_cache))
    torch.testing.assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=3e-2)


def test_mla_fp8_cache_triton_matches_torch():
    batch = MlaBatch([(30, 1), (10, 6)], 4, 32, 16, kv_cache_dtype="fp8", k_scale=0.5)
    out, cache = batch.run(TritonBackend)
    ref_out, ref_cache = batch.run(TorchBackend)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ref_out.double(), batch.reference(), atol=1e-4, rtol=1e-4)


def test_registry_serves_mla_on_torch_and_triton_only():
    registry = get_registry()
    spec = mla_spec(4, 32, 16, device=torch.device("cpu"))
    assert registry.attention_backend(None, spec).name == "TORCH"  # CPU auto-selection
    assert registry.attention_backend("TRITON", spec).name == "TRITON"
    with pytest.raises(ValueError, match=r"CPU_ATTN cannot run here: it does not serve MLA attention "
                                         r"\(backends that do: TORCH, TRITON\)"):
        registry.attention_backend("CPU_ATTN", spec)
    for name in ("FLASH_ATTN", "FLASHINFER"):
        assert "mla" not in registry.attention_backends[name].kinds


def test_triton_refuses_latents_it_has_no_tiles_for():
    reasons = TritonBackend.check(mla_spec(4, 1024, 64))
    assert any("MLA latent of 1088" in r for r in reasons), reasons
