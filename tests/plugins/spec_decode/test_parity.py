"""Speculative decoding is lossless (speculation is forced on: `"adaptive": false`): greedy output with every method equals the output
without speculation (tokens, text, finish reasons, logprobs) on tiny random models of each
architecture, through chunked prefill, prefix caching, preemption and n > 1; stops inside
an accepted run end the output where decoding one token at a time would; and sampled
tokens keep their distribution (a two-sample chi-square test that a broken rejection
sampler fails)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core import sampler as sampler_module
from tests.conftest import TEST_DEVICE
from tests._eagle3 import write_head

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
LOGPROB_ATOL = 1e-4


def methods(model_dir, scratch) -> dict[str, dict]:
    """Every method's config for `model_dir`; the EAGLE-3 head is written under `scratch`
    (never inside the shared model directory, which other tests copy)."""
    head = write_head(scratch / "eagle3-head", model_dir, aux_layers=[0, 1, 1])  # the tiny targets have 2 layers
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                  "adaptive": False},
        "suffix": {"method": "suffix", "num_speculative_tokens": 6, "adaptive": False},
        "draft_model": {"model": str(model_dir), "num_speculative_tokens": 3, "adaptive": False},
        "eagle3": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False},
    }
    if TEST_DEVICE != "cpu" and importlib.util.find_spec("arctic_inference") is None:
        del configs["suffix"]  # a GPU machine without a registry cannot build it (CI always has it)
    return configs


def prompts(seed: int = 0) -> list[list[int]]:
    """Random prompts, some repeating a segment (something for ngram to find)."""
    rng = random.Random(seed)
    out = []
    for n in (5, 23, 40, 2, 61):
        ids = [rng.randrange(2, 500) for _ in range(n)]
        out.append(ids + ids[: n // 2] if n > 10 else ids)
    return out


def llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 1 << 24)
    return LLM(str(model_dir), dtype="float32", device=TEST_DEVICE, **kwargs)


def generate(engine: LLM, prompt_ids, params: SamplingParams):
    return engine.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)


def assert_same(got, want, label: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(g.outputs, w.outputs)):
            where = f"{label}: prompt {i} sequence {j}"
            assert a.token_ids == b.token_ids, f"{where}: tokens differ\n spec {a.token_ids}\n base {b.token_ids}"
            assert a.text == b.text, f"{where}: text differs"
            assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason), f"{where}: finish differs"
            if b.logprobs is not None:
                assert len(a.logprobs) == len(b.logprobs), f"{where}: logprob count differs"
                for step, (ra, rb) in enumerate(zip(a.logprobs, b.logprobs)):
                    for token, lp in rb.items():
                        assert ra[token].logprob == pytest.approx(lp.logprob, abs=LOGPROB_ATOL), \
                            f"{where} step {step}: logprob of {token} differs"


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_unchanged_by_every_method(tiny_model_dir, arch, tmp_path):
    model = tiny_model_dir(arch)
    ids = prompts()
    base = generate(llm(model), ids, GREEDY)
    accepted = {}
    for name, config in methods(model, tmp_path).items():
        engine = llm(model, speculative_config=config)
        # twice: the second pass finds the first one's outputs (suffix trees, ngram matches)
        for _ in range(2):
            assert_same(generate(engine, ids, GREEDY), base, f"{arch} {name}")
        stats = engine.engine.scheduler.spec_stats
        assert stats.num_drafts > 0, f"{arch} {name}: nothing was ever proposed"
        accepted[name] = (stats.num_accepted_tokens, stats.num_draft_tokens)
    assert accepted["draft_model"][0] == accepted["draft_model"][1], \
        "a draft model equal to the target must have every draft accepted"
    assert accepted["suffix"][0] > 0, "suffix decoding never had a draft accepted on repeated requests"


@pytest.mark.parametrize("name", ["ngram", "suffix", "draft_model", "eagle3"])
def test_chunked_prefill_prefix_caching_preemption_and_n(tiny_model_dir, name, tmp_path):
    model = tiny_model_dir("llama")
    rng = random.Random(1)
    shared = [rng.randrange(2, 500) for _ in range(24)]
    ids = [shared + p for p in prompts(2)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2, n=2)
    # a budget of 16 tokens per step cuts prefills into chunks and drafts short; 14 blocks
    # of 16 tokens cannot hold every request at once: some are preempted and recomputed
    # (a draft model's layers take as many bytes per token as the target's, the EAGLE-3
    # head's one layer half)
    per_token = 512 + {"draft_model": 512, "eagle3": 256}.get(name, 0)
    settings = dict(max_num_batched_tokens=16, kv_cache_memory=14 * 16 * per_token, max_model_len=160,
                    enable_prefix_caching=True)
    base = generate(llm(model, **settings), ids, params)
    engine = llm(model, speculative_config=methods(model, tmp_path)[name], **settings)
    for _ in range(2):
        assert_same(generate(engine, ids, params), base, name)
    assert engine.engine.scheduler.num_preemptions > 0, "the test meant to preempt"
    assert engine.engine.block_manager.prefix_hit_rate > 0, "the test meant to hit the prefix cache"


def test_stops_inside_an_accepted_run(tiny_model_dir):
    """A draft model equal to the target has every draft accepted, so stops fall inside
    accepted runs: stop token ids, EOS, max_tokens and stop strings must end the output
    exactly where one token per step would, with the usage counts to match."""
    model = tiny_model_dir("llama")
    ids = prompts(3)
    plain = generate(llm(model), ids, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    mid = [o.outputs[0].token_ids[7] for o in plain]
    texts = [o.outputs[0].text for o in plain]
    stop_strings = [t[len(t) // 2: len(t) // 2 + 3] for t in texts if len(t) > 8][:2]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=mid[:3], logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=30, stop=stop_strings, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=30, stop=stop_strings, include_stop_str_in_output=True),
    ]
    engine = llm(model, speculative_config={"model": str(model), "num_speculative_tokens": 4,
                                                   "adaptive": False})
    base_engine = llm(model)
    for params in cases:
        base = generate(base_engine, ids, params)
        got = generate(engine, ids, params)
        assert_same(got, base, f"stop case {params}")
        for g, b in zip(got, base):
            assert len(g.outputs[0].token_ids) == len(b.outputs[0].token_ids)
    stats = engine.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def _second_token_counts(engine: LLM, prompt: list[int], samples: int, vocab: int, seed: int) -> torch.Tensor:
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True, n=samples, seed=seed)
    out = engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    counts = torch.zeros(vocab)
    for seq in out.outputs:
        counts[seq.token_ids[2]] += 1
    return counts


def two_sample_chi_square(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of two histograms (categories seen fewer than 5 times in both
    pooled into one) and its degrees of freedom."""
    keep = (a + b) >= 10
    a = torch.cat([a[keep], a[~keep].sum()[None]])
    b = torch.cat([b[keep], b[~keep].sum()[None]])
    used = (a + b) > 0
    a, b = a[used], b[used]
    na, nb = a.sum(), b.sum()
    stat = ((a * (nb / na) ** 0.5 - b * (na / nb) ** 0.5) ** 2 / (a + b)).sum()
    return float(stat), int(used.sum()) - 1


def chi2_critical(dof: int) -> float:
    """The p = 0.001 critical value (Wilson-Hilferty approximation)."""
    z = 3.09
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


SAMPLES = 3000


def _distributions_differ(model, monkeypatch=None) -> tuple[float, float]:
    prompt = prompts(4)[1]
    vocab = 512
    base = _second_token_counts(llm(model), prompt, SAMPLES, vocab, seed=11)
    spec = _second_token_counts(llm(model, speculative_config={"model": str(model), "num_speculative_tokens": 2,
                                                               "adaptive": False}),
                                prompt, SAMPLES, vocab, seed=12)
    stat, dof = two_sample_chi_square(base, spec)
    return stat, chi2_critical(dof)


def test_sampling_keeps_the_distribution(tiny_model_dir):
    stat, critical = _distributions_differ(tiny_model_dir("llama"))
    assert stat < critical, f"third-token histograms differ with speculation (chi2 {stat:.1f} >= {critical:.1f})"


def test_a_broken_rejection_sampler_is_caught(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(sampler_module, "_residual", lambda probs, q, has_draft: probs)
    stat, critical = _distributions_differ(tiny_model_dir("llama"))
    assert stat > critical, f"a sampler resampling from p after a rejection went unnoticed (chi2 {stat:.1f})"
