"""Sliding-window attention (Mistral, Qwen2/Qwen3 `use_sliding_window`) against
transformers on tiny random models whose window (16) is shorter than most prompts:
which layers slide, greedy parity through plain, chunked-prefill, prefix-caching and
preemption runs on TORCH and CPU_ATTN (TRITON instead on a GPU; interpreted here on one small case), and what
an all-windowed model buys: blocks older than the window go back to the pool while the
request runs, so a sequence longer than the whole cache completes.

transformers' window (masking_utils.sliding_window_overlay, `kv_idx > q_idx - window`):
a query at p sees keys p - W + 1 .. p, the same rule as our backends.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from pagedllm.core.contracts import KVCacheSpec
from tests._models import reference as shared_reference
from pagedllm.plugins.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedllm.plugins.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from tests.conftest import NATIVE_BACKEND, build_tiny_model
from tests.test_llm import assert_parity, make_prompts, new_llm, run_engine

BACKENDS = ["TORCH", NATIVE_BACKEND]
WINDOW = 16
MODELS = {
    # every layer windowed
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    # layer 0 global, layer 1 windowed (layers from max_window_layers on slide)
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # explicit layer_types: sliding then global
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention"])),
}
PROMPTS = make_prompts(seed=7, lens=[40, 17, 64, 100, 3, 25])


def config(name: str, **kw):
    import transformers

    cls = {"mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig"}[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, cls)(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, **kw)


def hf_windows(name: str, cfg) -> tuple:
    """The window each layer of transformers' model attends with: Qwen's attention layers
    carry it; Mistral's mask is the config's window on every layer; Llama has none."""
    import transformers

    if name == "llama":
        return ()
    if name == "mistral":
        return (cfg.sliding_window,) * cfg.num_hidden_layers if cfg.sliding_window is not None else ()
    model_cls = {"qwen2": transformers.Qwen2Model, "qwen3": transformers.Qwen3Model}[name]
    windows = tuple(layer.self_attn.sliding_window for layer in model_cls(cfg).layers)
    return () if all(w is None for w in windows) else windows


@pytest.mark.parametrize("name,model_cls,kw", [
    ("qwen2", Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    ("qwen2", Qwen2ForCausalLM, dict(use_sliding_window=False, sliding_window=8, max_window_layers=2)),
    ("qwen2", Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    ("qwen3", Qwen3ForCausalLM, dict(use_sliding_window=True, sliding_window=8,
                                     layer_types=["full_attention", "sliding_attention"] * 2)),
    ("qwen3", Qwen3ForCausalLM, dict(use_sliding_window=True, sliding_window=8, max_window_layers=4)),
    ("mistral", MistralForCausalLM, dict(sliding_window=8)),
    ("mistral", MistralForCausalLM, dict(sliding_window=None)),
    # transformers' Mistral ignores layer_types (it warns), applying the window everywhere
    ("mistral", MistralForCausalLM, dict(sliding_window=8, layer_types=["full_attention", "sliding_attention"] * 2)),
    # transformers' Llama ignores a stray sliding_window
    ("llama", LlamaForCausalLM, dict(sliding_window=8)),
])
def test_windowed_layers_are_the_ones_transformers_windows(name, model_cls, kw):
    cfg = config(name, **kw)
    spec: KVCacheSpec = model_cls.kv_cache_spec(cfg)
    assert spec.sliding_windows == hf_windows(name, cfg)


def test_sliding_layer_types_without_a_window_are_refused():
    cfg = config("qwen2", use_sliding_window=False, layer_types=["full_attention", "sliding_attention"] * 2)
    with pytest.raises(ValueError, match="sets no sliding_window"):
        Qwen2ForCausalLM.kv_cache_spec(cfg)


_DIRS: dict = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    def make(name: str):
        if name not in _DIRS:
            arch, kw = MODELS[name]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _DIRS[name] = build_tiny_model(tmp_path_factory.mktemp(name), arch, **kw)
        return _DIRS[name]
    return make


def reference(path, prompts, num_tokens: int = 32):
    return shared_reference(path, prompts, num_tokens, varied=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_parity_plain_and_chunked(model_dir, name, backend):
    path = model_dir(name)
    ref = reference(path, PROMPTS)
    llm = new_llm(path, attention_backend=backend)
    assert llm.engine.worker.kv_spec.sliding_windows, "the model must have windowed layers"
    assert_parity(run_engine(llm, PROMPTS), ref)
    assert_parity(run_engine(new_llm(path, attention_backend=backend, max_num_batched_tokens=16), PROMPTS), ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_prefix_caching_parity(model_dir, name, backend):
    path = model_dir(name)
    prompts = make_prompts(seed=8, lens=[5, 20, 33, 2], shared_prefix=70)
    llm = new_llm(path, attention_backend=backend)
    first = run_engine(llm, prompts[:1])
    rest = run_engine(llm, prompts[1:])
    assert_parity(first + rest, reference(path, prompts))
    assert all(o.num_cached_tokens >= 64 for o in rest), [o.num_cached_tokens for o in rest]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_preemption_parity(model_dir, name, backend):
    path = model_dir(name)
    # 2 layers x 2 kv heads x 16 dims x 4 bytes x 2 = 512 bytes/token; 12 blocks of 16 tokens
    llm = new_llm(path, attention_backend=backend, kv_cache_memory=12 * 16 * 512, max_model_len=160)
    outputs = run_engine(llm, PROMPTS)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_parity(outputs, reference(path, PROMPTS))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_triton_interpreted(model_dir):
    """TRITON (interpreted on the CPU): prompts past the window, prefill in chunks, 8 tokens."""
    path = model_dir("qwen2")
    prompts = make_prompts(seed=9, lens=[30, 5])
    llm = new_llm(path, attention_backend="TRITON", max_num_batched_tokens=16, enforce_eager=True)
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_parity(outputs, reference(path, prompts, num_tokens=8))


# ---------------------------------------------------------------------- block release

BYTES_PER_TOKEN = 512  # the tiny models: 2 layers x 2 kv heads x 16 dims x float32 x (K, V)
GENERATE = 120


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_windowed_model_runs_past_its_cache(model_dir, backend):
    """Mistral (every layer windowed): a cache of 6 blocks (96 tokens) serves a 20 + 120 token
    sequence. max_model_len 512 passes the memory plan (a sequence holds at most window +
    step + a block); the request's live blocks stay bounded, the pool's free count grows
    back while it runs, and the tokens are transformers'."""
    from pagedllm import SamplingParams

    path = model_dir("mistral")
    prompt = make_prompts(seed=10, lens=[20])[0]
    llm = new_llm(path, attention_backend=backend, kv_cache_memory=6 * 16 * BYTES_PER_TOKEN, max_model_len=512,
                  max_num_batched_tokens=16)
    engine, bm = llm.engine, llm.engine.block_manager
    assert bm.num_blocks == 6 and engine.worker.kv_window == WINDOW
    params = SamplingParams(temperature=0.0, max_tokens=GENERATE, ignore_eos=True, logprobs=5)
    engine.add_request("r", None, params, prompt)
    live, free, outputs = [], [], []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
        if "r" in bm.req_blocks:  # blocks of the table not yet released
            live.append(len(bm.req_blocks["r"]) - bm.released.get("r", 0))
            free.append(bm.num_free_blocks)
    assert len(prompt) + GENERATE > bm.num_blocks * bm.block_size  # longer than the whole cache
    assert max(live) <= -(-(WINDOW + 16) // 16) + 1, live
    assert any(b > a for a, b in itertools.pairwise(free)), "blocks must return to the pool while the request runs"
    assert engine.scheduler.num_preemptions == 0
    assert_parity(outputs, reference(path, [prompt], num_tokens=GENERATE))
    assert bm.num_free_blocks == bm.num_blocks


def test_a_model_with_a_global_layer_needs_the_whole_sequence_in_cache(model_dir):
    """The same cache and max_model_len with Qwen2 (one global layer): refused at start-up,
    since a sequence then keeps every block."""
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=512"):
        new_llm(model_dir("qwen2"), kv_cache_memory=6 * 16 * BYTES_PER_TOKEN, max_model_len=512,
                max_num_batched_tokens=16)


def test_window_semantics_match_transformers_mask():
    """transformers' sliding mask (the one its SDPA path uses) against ours on positions."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    mask_fn = sliding_window_causal_mask_function(WINDOW)
    for q in range(40):
        for k in range(40):
            ours = k <= q and k > q - WINDOW  # torch_ref: k_pos > q_pos - window, causal
            assert bool(mask_fn(0, 0, torch.tensor(q), torch.tensor(k))) == ours, (q, k)
