"""Every attention backend that can run on this GPU vs the TORCH reference (marker `cuda`).

Kernel level: one mixed step (decodes with long contexts, prefill chunks after cached
tokens) in float16 and bfloat16, plain, with sliding window + soft-cap, and with an FP8
cache where the backend has one. Engine level: a tiny random Llama generates through each
backend and must match TORCH's first-step logprobs. Backends that cannot run here
(library missing, block size, ...) are skipped with their `check()` reasons.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.contracts import AttentionSpec
from pagedllm.plugins.attention import pagedllm_attention_backends

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BACKENDS = pagedllm_attention_backends()
OTHERS = sorted(set(BACKENDS) - {"TORCH"})
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
REQUESTS = [(1500, 1), (37, 1), (0, 200), (300, 45), (700, 1), (5, 3)]


def cuda_spec(block_size: int, **options) -> AttentionSpec:
    return AttentionSpec(block_size=block_size, device=torch.device("cuda"), **options)


def runnable_block_size(backend, block_sizes=(16, 256), **options) -> int:
    """The first block size the backend takes for this spec; skip with its reasons if none."""
    reasons = []
    for block_size in block_sizes:
        reasons = backend.check(cuda_spec(block_size, **options))
        if not reasons:
            return block_size
    pytest.skip(f"{backend.name} cannot run here: {'; '.join(reasons)}")


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def to_backend_layout(backend, cache: torch.Tensor) -> torch.Tensor:
    """The reference's [2, blocks, ...] cache in the backend's own kv_cache_shape."""
    if tuple(backend.kv_cache_shape(*cache.shape[1:])) == tuple(cache.shape):
        return cache.clone()
    return cache.transpose(0, 1).contiguous()  # FLASHINFER: [blocks, 2, ...]


def forward(backend, batch, cache, window, soft_cap, k_scale, v_scale):
    impl = backend.impl_cls()(batch.spec, batch.scale, window, soft_cap)
    impl.k_scale, impl.v_scale = k_scale, v_scale
    metadata = backend.builder_cls()(batch.spec).build(batch.layout)
    out = impl.forward(batch.q, batch.k, batch.v, cache, metadata)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("variant", ["plain", "window-cap", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", OTHERS)
def test_backend_matches_reference(make_paged_batch, name, dtype, variant):
    backend = BACKENDS[name]
    kv_cache_dtype = "fp8" if variant == "fp8" else "auto"
    options = dict(num_heads=32, num_kv_heads=8, head_size=128, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    block_size = runnable_block_size(backend, **options)
    batch = make_paged_batch(REQUESTS, block_size=block_size, **options).to("cuda")
    window, soft_cap = (256, 30.0) if variant == "window-cap" else (None, None)
    k_scale, v_scale = (0.5, 0.25) if variant == "fp8" else (1.0, 1.0)

    ref_cache = batch.kv_cache.clone()
    expected = forward(BACKENDS["TORCH"], batch, ref_cache, window, soft_cap, k_scale, v_scale)
    cache = to_backend_layout(backend, batch.kv_cache)
    out = forward(backend, batch, cache, window, soft_cap, k_scale, v_scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    as_reference = cache if cache.shape == ref_cache.shape else cache.transpose(0, 1)
    assert torch.equal(raw_bytes(as_reference), raw_bytes(ref_cache)), "the KV write differs from the reference's"


@pytest.mark.parametrize("name", OTHERS)
def test_engine_logprobs_match_torch(tiny_model_dir, name):
    pytest.importorskip("transformers")
    from pagedllm import LLM, SamplingParams

    backend = BACKENDS[name]
    model_dir = tiny_model_dir("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    # the engine's block sizes stop at 128, so a backend needing more is skipped here
    block_size = runnable_block_size(backend, (16, 128), num_heads=4, num_kv_heads=2, head_size=64,
                                     dtype=torch.float16, kv_cache_dtype="auto")
    prompts = [{"prompt_token_ids": [5, 17, 42, 99, 3, 250, 7, 8, 61, 12, 33] * 3}, {"prompt_token_ids": [301, 2]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    results = {}
    for backend_name in ("TORCH", name):
        llm = LLM(str(model_dir), dtype="float16", device="cuda", attention_backend=backend_name,
                  block_size=block_size, kv_cache_memory=1 << 26)
        results[backend_name] = llm.generate(prompts, params, use_tqdm=False)
        del llm
    for out, ref in zip(results[name], results["TORCH"]):
        first, ref_first = out.outputs[0].logprobs[0], ref.outputs[0].logprobs[0]
        for token in first.keys() & ref_first.keys():
            assert first[token].logprob == pytest.approx(ref_first[token].logprob, abs=5e-2)
