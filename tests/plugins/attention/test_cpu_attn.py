"""CPU_ATTN (native paged attention on the CPU) vs the TORCH reference.

Each case is one step on a random paged batch (shuffled, non-contiguous blocks) mixing
decodes with prefill chunks after cached tokens. Both backends start from the same cache;
outputs must match and the written cache must be identical. Chunks longer than
NATIVE_MAX_QUERY_LEN go through the reference path inside CPU_ATTN where the kernel
attends row at a time: tests lower the threshold (and turn the prefill tiles off) so one
step mixes both paths; with tiles every chunk stays native. Also: `check()` says why CPU_ATTN cannot run,
auto-selection prefers it on the CPU, and a whole-engine run gives TORCH's tokens.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.contracts import AttentionSpec
from pagedllm.core.plugins import get_registry
from pagedllm.plugins.attention import cpu_attn
from pagedllm.plugins.attention.cpu_attn import CpuAttnBackend
from pagedllm.plugins.attention.torch_ref import TorchBackend
from pagedllm.ops.cpu import features, native

TOLERANCE = 1e-5
# where CPU_ATTN keeps a bf16 cache when allowed (its kernels' 512-bit path, native bf16)
BF16_CACHE_HERE = native.available() and native.bf16_kv_available() and features.detect().native_bf16

needs_native = pytest.mark.skipif(not native.available(),
                                  reason="native CPU kernels unavailable (no C compiler or PAGEDLLM_CPU_KERNELS=0)")


def run_backend(backend, batch, *, window=None, soft_cap=None, k_slice=False):
    """One forward on a copy of the batch's cache; returns (output, cache after the write, metadata).

    k_slice: pass q/k/v as column slices of one fused [T, (H + 2 KVH) D] tensor, as the
    model does (rows contiguous, token stride wider than a row).
    """
    cache = batch.kv_cache.clone()
    metadata = backend.builder_cls()(batch.spec).build(batch.layout)
    impl = backend.impl_cls()(batch.spec, batch.scale, window, soft_cap)
    q, k, v = batch.q, batch.k, batch.v
    if k_slice:
        t, h, d = q.shape
        kvh = k.shape[1]
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
        q = qkv[:, :h * d].view(t, h, d)
        k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
        v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    return impl.forward(q, k, v, cache, metadata), cache, metadata


def compare(batch, **attention_options):
    out, cache, metadata = run_backend(CpuAttnBackend, batch, **attention_options)
    ref_out, ref_cache, _ = run_backend(TorchBackend, batch, **{k: v for k, v in attention_options.items()
                                                                 if k != "k_slice"})
    assert torch.equal(cache, ref_cache), "CPU_ATTN's KV write differs from TORCH's"
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert torch.isfinite(out).all(), "CPU_ATTN left rows unwritten or produced non-finite values"
    err = (out - ref_out).abs()
    if not torch.allclose(out, ref_out, atol=TOLERANCE, rtol=TOLERANCE):
        row = int(err.amax(dim=(1, 2)).argmax())
        pytest.fail(f"CPU_ATTN differs from TORCH: max error {err.max().item():.3g} at token row {row} "
                    f"(query_start_loc {batch.layout.query_start_loc_cpu.tolist()})")
    return metadata


# (requests as (cached tokens, new tokens), batch options, attention options)
CASES = {
    "mha-ragged": ([(0, 1), (37, 1), (0, 20), (40, 9)], dict(num_heads=2, num_kv_heads=2), {}),
    "gqa4-head128-block32": ([(300, 1), (5, 1), (33, 17)],
                             dict(num_heads=8, num_kv_heads=2, head_size=128, block_size=32), {}),
    "gqa3-head20": ([(60, 1), (0, 20), (17, 4)], dict(num_heads=6, num_kv_heads=2, head_size=20), {}),
    "gqa8-chunk-at-block-edge": ([(150, 1), (0, 1), (16, 16), (64, 3)], dict(num_heads=8, num_kv_heads=1), {}),
    "long-decode-many-blocks": ([(1000, 1), (20, 1)], dict(num_heads=4, num_kv_heads=1), {}),
    "single-prefill": ([(0, 33)], dict(num_heads=4, num_kv_heads=2), {}),
    "sliding-window": ([(300, 1), (70, 30), (10, 5)], dict(num_heads=8, num_kv_heads=2), dict(window=100)),
    "soft-cap": ([(90, 1), (0, 24)], dict(num_heads=4, num_kv_heads=1), dict(soft_cap=5.0)),
    "window-and-cap-small": ([(200, 1), (70, 30)], dict(num_heads=8, num_kv_heads=2),
                             dict(window=48, soft_cap=5.0)),
    "head80-fused-qkv": ([(40, 1), (10, 7)], dict(num_heads=2, num_kv_heads=1, head_size=80),
                         dict(k_slice=True)),
    "gqa4-fused-qkv": ([(40, 1), (0, 12), (7, 1)], dict(num_heads=8, num_kv_heads=2), dict(k_slice=True)),
}


@needs_native
@pytest.mark.parametrize("requests, batch_options, attention_options", CASES.values(), ids=CASES.keys())
def test_matches_reference(make_paged_batch, requests, batch_options, attention_options):
    batch = make_paged_batch(requests, **batch_options)
    metadata = compare(batch, **attention_options)
    assert metadata.num_native == len(requests) and not metadata.long_groups, \
        "chunks below NATIVE_MAX_QUERY_LEN should all go to the native kernel"


# requests, threshold: which requests (by index) must go through the reference path
LONG_CASES = {
    "mixed": ([(0, 1), (37, 1), (0, 20), (40, 9), (5, 3), (60, 12)], 8, dict(), [2, 3, 5]),
    "mixed-window-cap": ([(90, 1), (0, 20), (30, 2), (70, 30)], 8, dict(window=40, soft_cap=5.0), [1, 3]),
    "one-long-first": ([(10, 17), (50, 1), (3, 4)], 16, dict(), [0]),
    "all-long": ([(0, 20), (40, 9)], 4, dict(), [0, 1]),
    "one-long-only": ([(12, 40)], 16, dict(), [0]),
    "at-threshold": ([(0, 8), (30, 9), (2, 1)], 8, dict(), [1]),
}


@needs_native
@pytest.mark.parametrize("requests, threshold, attention_options, long_reqs", LONG_CASES.values(),
                         ids=LONG_CASES.keys())
def test_long_chunks_take_the_reference_path(make_paged_batch, monkeypatch, requests, threshold,
                                             attention_options, long_reqs):
    monkeypatch.setattr(cpu_attn, "NATIVE_MAX_QUERY_LEN", threshold)
    monkeypatch.setattr(native, "attention_tiles", lambda head_size, group: False)
    batch = make_paged_batch(requests, num_heads=8, num_kv_heads=2)
    metadata = compare(batch, **attention_options)
    qsl = batch.layout.query_start_loc_cpu.tolist()
    long_rows = [g.rows for g in metadata.long_groups]
    assert long_rows == [slice(qsl[i], qsl[i + 1]) for i in long_reqs], \
        f"reference-path groups {long_rows} are not the chunks longer than {threshold}"
    native_reqs = [i for i in range(len(requests)) if i not in long_reqs]
    assert metadata.num_native == len(native_reqs)
    assert metadata.row_start.tolist() == [qsl[i] for i in native_reqs], "native rows do not start where they should"


@needs_native
@pytest.mark.parametrize("attention_options", [dict(), dict(window=40)], ids=["plain", "window"])
def test_prefill_tiles_keep_long_chunks_native(make_paged_batch, monkeypatch, attention_options):
    """Where the kernel attends prefill chunks by tiles, no chunk goes to the reference path
    however long (the threshold lowered to 4 here), and the results still match it."""
    if not native.attention_tiles(64, 4):
        pytest.skip("this build attends row at a time (no 512-bit path)")
    monkeypatch.setattr(cpu_attn, "NATIVE_MAX_QUERY_LEN", 4)
    requests = [(0, 40), (30, 17), (5, 1), (100, 33), (16, 16)]
    batch = make_paged_batch(requests, num_heads=8, num_kv_heads=2)
    metadata = compare(batch, **attention_options)
    assert metadata.num_native == len(requests) and not metadata.long_groups, \
        "a long chunk left the native kernel although it attends by tiles"


@needs_native
def test_requests_without_new_tokens_are_harmless(make_paged_batch, monkeypatch):
    """A request with no query rows in the layout (its count does not move) changes nothing,
    on the all-native path and when long chunks split the batch."""
    requests = [(20, 3), (40, 0), (0, 12), (9, 1)]
    batch = make_paged_batch(requests, num_heads=4, num_kv_heads=2)
    out, cache, _ = run_backend(CpuAttnBackend, batch)
    ref_out, ref_cache, _ = run_backend(TorchBackend, batch)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, ref_out, atol=TOLERANCE, rtol=TOLERANCE)
    monkeypatch.setattr(cpu_attn, "NATIVE_MAX_QUERY_LEN", 4)
    monkeypatch.setattr(native, "attention_tiles", lambda head_size, group: False)
    out, cache, metadata = run_backend(CpuAttnBackend, batch)
    assert metadata.num_native == 2 and len(metadata.long_groups) == 1
    torch.testing.assert_close(out, ref_out, atol=TOLERANCE, rtol=TOLERANCE)


# ------------------------------------------------------------------ check() and selection

def spec(**overrides) -> AttentionSpec:
    options = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32, kv_cache_dtype="auto",
                   block_size=16, device=torch.device("cpu"))
    options.update(overrides)
    return AttentionSpec(**options)


@pytest.fixture
def kernels_off(monkeypatch):
    """PAGEDLLM_CPU_KERNELS=0 for one test; the cached library lookup is redone before and after."""
    native.forget_kernels()
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    yield
    monkeypatch.delenv("PAGEDLLM_CPU_KERNELS")
    native.forget_kernels()


@needs_native
def test_check_says_why():
    assert CpuAttnBackend.check(spec()) == []
    assert CpuAttnBackend.check(spec(num_heads=6, head_size=20, block_size=32)) == []
    assert CpuAttnBackend.check(spec(dtype=torch.bfloat16)) == [], "bf16 models run on a float32 cache"
    reasons = CpuAttnBackend.check(spec(dtype=torch.float16))
    assert len(reasons) == 1 and "float16" in reasons[0] and "bfloat16" in reasons[0], reasons
    for fp8 in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        reasons = CpuAttnBackend.check(spec(kv_cache_dtype=fp8))
        assert len(reasons) == 1 and fp8 in reasons[0] and "FP8" in reasons[0], (fp8, reasons)
    reasons = CpuAttnBackend.check(spec(device=torch.device("cuda")))
    assert len(reasons) == 1 and "CPU only" in reasons[0], reasons
    # every reason at once, and none about the kernels when something else already rules it out
    assert len(CpuAttnBackend.check(spec(device=torch.device("cuda"), dtype=torch.float16,
                                         kv_cache_dtype="fp8"))) == 3


def test_check_without_native_kernels(kernels_off):
    assert not native.available()
    reasons = CpuAttnBackend.check(spec())
    assert len(reasons) == 1 and "native CPU kernels unavailable" in reasons[0] \
        and "PAGEDLLM_CPU_KERNELS=0" in reasons[0], reasons
    # auto-selection then falls back to the reference
    assert get_registry().attention_backend(None, spec()) is TorchBackend
    with pytest.raises(ValueError, match="CPU_ATTN cannot run here"):
        get_registry().attention_backend("CPU_ATTN", spec())


@needs_native
def test_auto_selection_on_the_cpu():
    registry = get_registry()
    assert registry.attention_backends["CPU_ATTN"] is CpuAttnBackend
    assert registry.attention_backend(None, spec()) is CpuAttnBackend, "float32 on the CPU should pick CPU_ATTN"
    assert registry.attention_backend("cpu_attn", spec()) is CpuAttnBackend
    assert registry.attention_backend(None, spec(dtype=torch.bfloat16)) is CpuAttnBackend
    assert TorchBackend.kv_cache_dtype(spec(dtype=torch.bfloat16)) == torch.bfloat16
    # the cache dtype: bf16 where exact or allowed and the kernels have it, else float32
    bf16_here = torch.bfloat16 if BF16_CACHE_HERE else torch.float32
    assert CpuAttnBackend.kv_cache_dtype(spec(dtype=torch.bfloat16)) == bf16_here
    assert CpuAttnBackend.kv_cache_dtype(spec(matmul_precision="medium")) == bf16_here
    assert CpuAttnBackend.kv_cache_dtype(spec()) == torch.float32, "a float32 model at highest precision"
    assert CpuAttnBackend.kv_cache_dtype(spec(matmul_precision="medium", head_size=20)) == torch.float32
    # what CPU_ATTN refuses goes to TORCH
    assert registry.attention_backend(None, spec(dtype=torch.float16)) is TorchBackend
    assert registry.attention_backend(None, spec(kv_cache_dtype="fp8")) is TorchBackend
    assert CpuAttnBackend.priority["cpu"] > TorchBackend.priority["cpu"]
    assert "cuda" not in CpuAttnBackend.priority


# ------------------------------------------------------------------ whole engine

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 61, 12, 33], [301, 2, 77]]
NUM_TOKENS = 8


def generate(model_dir, dtype="float32", **kwargs):
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, device="cpu", kv_cache_memory=1 << 22, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
    return llm, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def logprob_rows(output):
    return [{t: lp.logprob for t, lp in step.items()} for step in output.outputs[0].logprobs]


@needs_native
@pytest.mark.parametrize("threshold", [cpu_attn.NATIVE_MAX_QUERY_LEN, 4], ids=["native", "long-prompt-on-reference"])
def test_cpu_attn_matches_torch(tiny_model_dir, monkeypatch, threshold):
    monkeypatch.setattr(cpu_attn, "NATIVE_MAX_QUERY_LEN", threshold)
    monkeypatch.setattr(native, "attention_tiles", lambda head_size, group: False)  # row path + SDPA
    calls = {"native": 0, "reference": 0}

    def count(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(native, "paged_attention", count("native", native.paged_attention))
    monkeypatch.setattr(cpu_attn.CpuAttentionImpl, "attend_groups",
                        count("reference", cpu_attn.CpuAttentionImpl.attend_groups))
    model_dir = tiny_model_dir("llama")
    llm, got = generate(model_dir)  # auto-selected on the CPU
    assert llm.engine.worker.backend.name == "CPU_ATTN"
    assert calls["native"] > 0, "the native kernel never ran"
    if threshold < len(PROMPTS[0]):
        assert calls["reference"] > 0, f"no chunk longer than {threshold} went through the reference path"
    else:
        assert calls["reference"] == 0, "a short prompt went through the reference path"
    _, expected = generate(model_dir, attention_backend="TORCH")
    for i, (out, ref) in enumerate(zip(got, expected)):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, f"prompt {i}: greedy tokens differ"
        for step, (row, ref_row) in enumerate(zip(logprob_rows(out), logprob_rows(ref))):
            assert row.keys() == ref_row.keys(), f"prompt {i} step {step}: top-3 tokens differ"
            for token, logprob in row.items():
                assert logprob == pytest.approx(ref_row[token], abs=1e-4), \
                    f"prompt {i} step {step} token {token}: logprob {logprob} vs TORCH {ref_row[token]}"


# From transformers' own bf16 run, measured on this model: CPU_ATTN (float32 cache) 0.065 at
# most, our TORCH backend (bf16 cache, like transformers) 0.056: bf16's rounding, either way.
BF16_LOGPROB_ATOL = 0.1


@needs_native
@pytest.mark.parametrize("cache", ["bf16-where-available", "float32"])
def test_bf16_model_on_cpu_attn(tiny_model_dir, monkeypatch, cache):
    """A bf16 model on CPU_ATTN (bf16 cache where the kernels have one, which is exact for
    bf16 keys; else float32; bf16 in and out) against transformers in bf16,
    teacher-forced on our tokens: each logprob within BF16_LOGPROB_ATOL, and each greedy
    token within that of transformers' best (tiny random models have near-ties that bf16
    rounding may break either way, so token equality would test the noise)."""
    from transformers import AutoModelForCausalLM

    if cache == "float32":
        monkeypatch.setattr(native, "bf16_kv_available", lambda: False)
    expected_dtype = torch.bfloat16 if cache != "float32" and BF16_CACHE_HERE else torch.float32
    model_dir = tiny_model_dir("llama")
    llm, got = generate(model_dir, dtype="bfloat16")
    worker = llm.engine.worker
    assert worker.backend.name == "CPU_ATTN" and worker.kv_dtype == expected_dtype
    assert all(c.dtype == expected_dtype for c in worker.kv_caches)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    for i, (prompt, out) in enumerate(zip(PROMPTS, got)):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits, -1)
        for step, (token, row) in enumerate(zip(tokens, logprob_rows(out))):
            assert row[token] == pytest.approx(expected[step, token].item(), abs=BF16_LOGPROB_ATOL), \
                f"prompt {i} step {step}: logprob {row[token]} vs transformers bf16 {expected[step, token].item()}"
            assert expected[step].max().item() - expected[step, token].item() <= BF16_LOGPROB_ATOL, \
                f"prompt {i} step {step}: greedy token {token} is not transformers' best"


@needs_native
@pytest.mark.skipif(not BF16_CACHE_HERE, reason="no bf16-cache kernels or native bf16 on this CPU")
def test_medium_precision_keeps_a_bf16_cache(tiny_model_dir, monkeypatch):
    """A float32 model under "medium" matmul precision (the GGUF default) keeps a bf16
    cache: logprobs within BF16_LOGPROB_ATOL of the float32-cache run, the same greedy
    tokens wherever float32 had a clear best (a margin above that tolerance). The GEMMs keep
    float32 products in both runs, so the cache is all that differs: which layers take bf16
    products under "medium" is measured per machine (a tiny model's weights stay cached and
    took them from one row on a Zen 5), and those roundings are another test's subject."""
    from pagedllm.ops.cpu import crossover

    monkeypatch.setenv("PAGEDLLM_FLOAT32_MATMUL_PRECISION", "medium")
    monkeypatch.setattr(crossover, "rows_from", lambda what, small, large, k: crossover.NEVER)
    model_dir = tiny_model_dir("llama")
    llm, got = generate(model_dir)
    worker = llm.engine.worker
    assert worker.matmul_precision == "medium" and worker.kv_dtype == torch.bfloat16
    monkeypatch.setattr(native, "bf16_kv_available", lambda: False)
    ref_llm, expected = generate(model_dir)
    assert ref_llm.engine.worker.kv_dtype == torch.float32
    for i, (out, ref) in enumerate(zip(got, expected)):
        for step, (row, ref_row) in enumerate(zip(logprob_rows(out), logprob_rows(ref))):
            token, ref_token = out.outputs[0].token_ids[step], ref.outputs[0].token_ids[step]
            if token != ref_token:
                ranked = sorted(ref_row.values(), reverse=True)
                assert len(ranked) > 1 and ranked[0] - ranked[1] <= BF16_LOGPROB_ATOL, \
                    f"prompt {i} step {step}: token {token} vs {ref_token} where float32 had a clear best"
                break  # the continuations differ from here on
            assert row[token] == pytest.approx(ref_row[token], abs=BF16_LOGPROB_ATOL), \
                f"prompt {i} step {step}: logprob {row[token]} vs float32 cache {ref_row[token]}"
