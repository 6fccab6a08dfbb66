"""Tensor and pipeline parallelism through the whole engine (mp executor, 2 gloo ranks):
greedy tokens equal to transformers' (and so to one rank's), logprobs close, through
chunked prefill, prefix caching and preemption; KV heads replicated when there are fewer
than ranks; the ranks are gone once the engine shuts down."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from test_llm import assert_parity, make_prompts, reference, run_engine


def parallel_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 1 << 22)
    return LLM(str(model_dir), dtype="float32", device="cpu", **kwargs)


def _ranks_gone(llm: LLM) -> bool:
    procs = list(getattr(llm.engine.executor, "procs", {}).values())
    llm.engine.shutdown()
    return bool(procs) and all(not p.is_alive() for p in procs)


def test_tensor_parallel_chunked_prefill_prefix_cache_preemption(tiny_model_dir):
    """One TP=2 engine through every scheduler path at once: a 16-token budget chunks the
    prefills, a shared prefix hits the cache, a 12-block pool preempts."""
    model_dir = tiny_model_dir("qwen2")
    prompts = make_prompts(seed=3, lens=[5, 20, 33, 2, 40], shared_prefix=20)
    # per rank: 2 layers x 1 kv head x 16 dims x 4 bytes x 2 = 256 bytes/token
    llm = parallel_llm(model_dir, tensor_parallel_size=2, max_num_batched_tokens=16,
                       kv_cache_memory=12 * 16 * 256, max_model_len=160)
    first = run_engine(llm, prompts[:1])
    rest = run_engine(llm, prompts[1:])
    engine = llm.engine
    assert engine.worker.kv_spec.num_kv_heads == 1 and engine.worker.kv_spec.num_heads == 2
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert all(o.num_cached_tokens >= 16 for o in rest), [o.num_cached_tokens for o in rest]
    assert_parity(first + rest, reference(model_dir, prompts))
    assert _ranks_gone(llm), "a rank process outlived the engine's shutdown"


def test_tensor_parallel_replicates_a_single_kv_head(tiny_model_dir):
    model_dir = tiny_model_dir("llama", num_key_value_heads=1)
    prompts = make_prompts(seed=4, lens=[7, 30])
    llm = parallel_llm(model_dir, tensor_parallel_size=2)
    outputs = run_engine(llm, prompts)
    assert llm.engine.worker.kv_spec.num_kv_heads == 1
    assert_parity(outputs, reference(model_dir, prompts))
    llm.engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # llama: tied embeddings split over the stages
def test_pipeline_parallel(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    prompts = make_prompts(seed=5, lens=[9, 40, 3])
    llm = parallel_llm(model_dir, pipeline_parallel_size=2, max_num_batched_tokens=32)
    outputs = run_engine(llm, prompts)
    assert list(llm.engine.worker.stage_layers) == [0], "the driver is the first of two stages"
    assert_parity(outputs, reference(model_dir, prompts))
    assert _ranks_gone(llm)


def test_tensor_parallel_refuses_what_it_cannot_split(tiny_model_dir):
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        parallel_llm(tiny_model_dir("llama"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="larger than the model's 2 layers"):
        parallel_llm(tiny_model_dir("llama"), pipeline_parallel_size=3)


@pytest.mark.slow
def test_smollm2_tensor_parallel_matches_one_rank(smollm2_float):
    """The real SmolLM2-135M (float copy of the bundled GGUF). Its 9 query and 3 KV heads
    split over 3 ranks, not 2 (vLLM's rule too: the heads must divide), so TP=3 here."""
    from pagedllm import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    one = LLM(str(smollm2_float), dtype="float32", device="cpu", kv_cache_memory=1 << 24, max_model_len=256)
    expected = one.generate(prompts, params, use_tqdm=False)
    one.engine.shutdown()
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        parallel_llm(smollm2_float, tensor_parallel_size=2)
    three = parallel_llm(smollm2_float, tensor_parallel_size=3, kv_cache_memory=1 << 24, max_model_len=256)
    got = three.generate(prompts, params, use_tqdm=False)
    three.engine.shutdown()
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, (g.outputs[0].text, e.outputs[0].text)
        for a, b in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            token = next(iter(b))
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-3)


@pytest.mark.slow
def test_pipeline_parallel_on_the_bundled_gguf(smollm2_path):
    """The bundled SmolLM2 Q4_1 GGUF over 2 stages (its tied embedding is rebuilt, quantized,
    on the last stage): the same greedy tokens as one rank. Pipeline parallelism splits no
    matrix, so quantized layers need nothing of their own."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "Write a haiku about the sea:"]
    got = {}
    for pp in (1, 2):
        llm = LLM(smollm2_path, device="cpu", max_model_len=512, kv_cache_memory=64 << 20, pipeline_parallel_size=pp)
        got[pp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert got[2] == got[1]
