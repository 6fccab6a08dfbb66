"""TRITON kernels vs the TORCH reference: under the Triton interpreter on a CPU machine
(conftest.py switches it on), compiled on the GPU when there is one.

Each case is one step on a random paged batch (shuffled, non-contiguous blocks) that
mixes decodes with prefill chunks starting after cached tokens. Both backends start from
the same cache; outputs must match and the written cache bytes must be identical (FP8
included). The interpreter runs every program in Python, so cases stay tiny.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import DEVICE  # noqa: E402
from pagedllm.core.contracts import AttentionSpec  # noqa: E402
from pagedllm.plugins.attention.torch_ref import TorchBackend  # noqa: E402
from pagedllm.plugins.attention.triton_backend import TritonBackend, load_kernels  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def triton_runs_here():
    """Fail with the backend's own reasons (e.g. triton imported before the interpreter was on)."""
    reasons = TritonBackend.check(spec())
    if reasons:
        pytest.fail(f"TRITON cannot run in this test process: {'; '.join(reasons)}")


def run_backend(backend, batch, *, window=None, soft_cap=None, k_scale=1.0, v_scale=1.0):
    """One forward on a copy of the batch's cache; returns (output, cache after the write)."""
    cache = batch.kv_cache.clone()
    metadata = backend.builder_cls()(batch.spec).build(batch.layout)
    impl = backend.impl_cls()(batch.spec, batch.scale, window, soft_cap)
    impl.k_scale, impl.v_scale = k_scale, v_scale
    return impl.forward(batch.q, batch.k, batch.v, cache, metadata), cache


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


# (requests as (cached tokens, new tokens), batch options, attention options)
CASES = {
    "mha-ragged": ([(0, 1), (37, 1), (0, 20), (40, 9)], dict(num_heads=2, num_kv_heads=2), {}),
    "gqa4-head128-block32": ([(300, 1), (5, 1), (33, 17)],
                             dict(num_heads=8, num_kv_heads=2, head_size=128, block_size=32), {}),
    "gqa8-chunk-at-block-edge": ([(150, 1), (0, 1), (16, 16), (64, 3)], dict(num_heads=8, num_kv_heads=1), {}),
    "long-decode-many-blocks": ([(1000, 1), (20, 1)], dict(num_heads=4, num_kv_heads=1), {}),
    "sliding-window": ([(300, 1), (70, 30), (10, 5)], dict(num_heads=8, num_kv_heads=2), dict(window=100)),
    "soft-cap": ([(90, 1), (0, 24)], dict(num_heads=4, num_kv_heads=1), dict(soft_cap=5.0)),
    "window-and-cap-small": ([(200, 1), (70, 30)], dict(num_heads=8, num_kv_heads=2),
                             dict(window=48, soft_cap=5.0)),
    "fp8-e4m3-gqa8": ([(100, 1), (20, 12)], dict(num_heads=8, num_kv_heads=1, kv_cache_dtype="fp8"),
                      dict(k_scale=0.5, v_scale=2.0)),
    "fp8-e5m2-head128": ([(100, 1), (20, 12)],
                         dict(num_heads=2, num_kv_heads=2, head_size=128, kv_cache_dtype="fp8_e5m2"),
                         dict(k_scale=0.25, v_scale=1.5)),
    "float16-gqa4": ([(120, 1), (30, 20)], dict(num_heads=4, num_kv_heads=1, dtype=torch.float16), {}),
    "bfloat16-gqa4": ([(120, 1), (30, 20)], dict(num_heads=4, num_kv_heads=1, dtype=torch.bfloat16), {}),
    "head80-padded": ([(40, 1), (10, 7)], dict(num_heads=2, num_kv_heads=1, head_size=80), {}),
}


@pytest.mark.parametrize("requests, batch_options, attention_options", CASES.values(), ids=CASES.keys())
def test_matches_reference(make_paged_batch, requests, batch_options, attention_options):
    batch = make_paged_batch(requests, **batch_options).to(DEVICE)
    out, cache = run_backend(TritonBackend, batch, **attention_options)
    ref_out, ref_cache = run_backend(TorchBackend, batch, **attention_options)
    assert torch.equal(raw_bytes(cache), raw_bytes(ref_cache)), "the KV write differs from the reference's"
    tol = TOLERANCE[batch.spec.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)


def test_write_kv_skips_padding_slots(make_paged_batch):
    batch = make_paged_batch([(3, 5)], num_heads=2, num_kv_heads=2).to(DEVICE)
    slots = batch.layout.slot_mapping.clone()
    slots[1] = -1
    cache = batch.kv_cache.clone()
    load_kernels().write_kv(cache[0], cache[1], batch.k, batch.v, slots, 1.0, 1.0)
    expected = batch.kv_cache.clone()
    keep = slots >= 0
    expected[0].view(-1, 2, 64)[slots[keep]] = batch.k[keep]
    expected[1].view(-1, 2, 64)[slots[keep]] = batch.v[keep]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_write_rounds_like_torch(fp8):
    """The KV write must round exactly like torch (nearest, ties to even). On the CPU this
    checks the workaround for the interpreter's fp32->fp8 cast, which loses the carry when
    the mantissa rounds up (7.9 -> 4.0); on a GPU, the hardware cast."""
    gen = torch.Generator().manual_seed(1)
    magnitudes = torch.logspace(-12, 8, 64, base=2.0)[:, None, None]  # subnormals .. near the max
    values = torch.randn(64, 1, 64, generator=gen) * magnitudes
    scale = 0.75
    cache = torch.zeros(2, 4, 16, 1, 64, dtype=fp8)
    load_kernels().write_kv(cache[0], cache[1], values, -values, torch.arange(64, device=DEVICE), scale, scale)
    assert torch.equal(cache[0].reshape(64, 1, 64).view(torch.uint8), (values / scale).to(fp8).view(torch.uint8))
    assert torch.equal(cache[1].reshape(64, 1, 64).view(torch.uint8), (-values / scale).to(fp8).view(torch.uint8))


def test_decode_partitions_fill_the_gpu_only_when_needed():
    partition_size = load_kernels().decode_partition_size
    # batch 1, 8 kv heads, 2k context on a 132-SM GPU: split finely
    assert partition_size(1, 8, 2048, 264) == 64
    # batch 128: enough programs without splitting further than 1024
    assert partition_size(128, 8, 2048, 264) == 1024


def spec(**overrides) -> AttentionSpec:
    options = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32, kv_cache_dtype="auto",
                   block_size=16, device=DEVICE)
    options.update(overrides)
    return AttentionSpec(**options)


def test_check_says_why(monkeypatch):
    if DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert any("TRITON_INTERPRET=1" in r for r in TritonBackend.check(spec()))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonBackend.check(spec()) == []
    assert TritonBackend.check(spec(kv_cache_dtype="fp8_e5m2")) == []
    assert any("head size 8" in r for r in TritonBackend.check(spec(head_size=8)))
    assert any("float64" in r for r in TritonBackend.check(spec(dtype=torch.float64)))
    # runnable on the CPU, but the reference must keep winning auto-selection there
    assert TritonBackend.priority["cpu"] < TorchBackend.priority["cpu"]
