"""The proposers on their own, the checked `--speculative-config`, and the start-up
errors a user meets (unknown keys, a draft with another tokenizer)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.plugins import get_registry
from pagedllm.core.spec_decode import PayoffGuard, SpecStats, position_verdicts, resolve_spec_config
from pagedllm.plugins.spec_decode.ngram import propose_ngram


def brute_force_ngram(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The module doc's rule, one position at a time."""
    n_tok = len(tokens)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        suffix = tokens[n_tok - n:]
        ends = [e for e in range(n - 1, n_tok - 1) if tokens[e - n + 1:e + 1] == suffix]
        if ends:
            full = [e for e in ends if e <= n_tok - 1 - k]
            e = full[-1] if full else ends[0]
            return tokens[e + 1:e + 1 + k]
    return []


def test_ngram_matches_a_brute_force_search():
    rng = random.Random(0)
    histories, want, caps = [], [], []
    for trial in range(300):
        alphabet = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 60))]
        lo = rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 4)
        k = rng.randrange(1, 6)
        got = propose_ngram([np.array(tokens)], lo, hi, [k])[0]
        assert got == brute_force_ngram(tokens, lo, hi, k), f"trial {trial}: {tokens} lo={lo} hi={hi} k={k}"
        histories.append(np.array(tokens))
        want.append(brute_force_ngram(tokens, 2, 3, 4))
        caps.append(4)
    assert propose_ngram(histories, 2, 3, caps) == want, "a batch must give what each request gives alone"


def test_ngram_examples():
    assert propose_ngram([np.array([1, 2, 3, 9, 9, 1, 2, 3])], 2, 3, [2]) == [[9, 9]]
    assert propose_ngram([np.array([1, 2, 3, 4])], 1, 3, [3]) == [[]], "no earlier occurrence"
    assert propose_ngram([np.array([7, 7, 7, 7, 7])], 2, 2, [3]) == [[7, 7, 7]], "a periodic run: k tokens"
    assert propose_ngram([np.array([1, 2, 1, 2])], 2, 2, [0]) == [[]], "no room for drafts"


def test_config_defaults_and_errors():
    registry = get_registry()
    cfg = resolve_spec_config({"method": "ngram", "num_speculative_tokens": 4}, registry)
    assert (cfg.options["prompt_lookup_min"], cfg.options["prompt_lookup_max"]) in ((None, None),)
    cfg = resolve_spec_config({"model": "/a/draft", "num_speculative_tokens": 2}, registry)
    assert cfg.method == "draft_model", "vLLM: a config with a model and no method is a draft model"
    assert resolve_spec_config({"method": "suffix"}, registry).num_speculative_tokens == 24
    assert resolve_spec_config({}, registry) is None
    errors = [
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
         "prompt_lookup_min=5 must be <= prompt_lookup_max=2"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "suffix_decoding_min_token_prob must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
        ({"num_speculative_tokens": 2}, "needs a \"method\""),
    ]
    for raw, message in errors:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            resolve_spec_config(raw, registry)
    with pytest.raises(ValueError, match="valid keys: .*prompt_lookup_max"):
        resolve_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup": 3}, registry)


def test_eagle1_needs_its_head():
    assert resolve_spec_config({"method": "eagle", "model": "/a/head", "num_speculative_tokens": 3},
                               get_registry()).method == "eagle"
    with pytest.raises(ValueError, match="needs \"model\""):
        resolve_spec_config({"method": "eagle", "num_speculative_tokens": 3}, get_registry())


def play(n: int, accept: float, per_row: float, k_max: int = 4, steps: int = 400, eager_first: int = 0) -> list[int]:
    """The k a PayoffGuard picks at each of `steps` steps of n requests, where a step of r
    rows takes 10 ms + per_row * r (as on a CPU; 3x that the first `eager_first` times a
    row count runs: warm-up and recording) and a fraction `accept` of first drafts is
    accepted."""
    guard = PayoffGuard(k_max=k_max)
    chosen, k, runs = [], 0, {}
    for _ in range(steps):
        rows = n * (1 + k)
        runs[rows] = runs.get(rows, 0) + 1
        guard.record_step(rows, (0.010 + per_row * rows) * (3 if runs[rows] <= eager_first else 1))
        if k:
            guard.record_acceptance(n, round(accept * n))
        k = guard.drafts(n)
        chosen.append(k)
    return chosen


def test_payoff_guard_drafts_where_they_pay():
    """Step time grows with rows as on a CPU (fixed cost + per row); the guard must learn
    it from the steps it sees and draft k for a lone stream but none for a large batch
    when drafts are rarely accepted."""
    assert min(play(1, accept=0.8, per_row=0.0005)[-100:]) == 4, "cheap rows and good drafts: always k"
    costly = play(32, accept=0.3, per_row=0.002)[-100:]
    assert sum(costly) <= len(costly) // PayoffGuard.PROBE + 1, \
        "costly rows and poor drafts: no drafts but the acceptance probes"
    middle = play(32, accept=0.8, per_row=0.0005)[-100:]
    assert 0 < min(middle) and max(middle) < 4, f"in between, some drafts: {sorted(set(middle))}"


def test_payoff_guard_widens_drafts_step_by_step():
    """In a wide batch, exploration doubles k from the widest measured step and stops where
    widening stops paying: a batch whose single drafts do not pay never runs a k_max-wide
    step (suffix decoding's k_max 24 at 32 requests is an 800-row step), one whose drafts
    pay reaches k_max; a lone stream (25 rows at k_max) measures k_max at once."""
    batch = play(32, accept=0.3, per_row=0.002, k_max=24)
    assert max(batch) == 1, f"a batch where one draft does not pay tried k up to {max(batch)}"
    wide = play(16, accept=0.9, per_row=0.00001, k_max=24)
    widths = sorted(set(wide))
    assert widths[:5] == [0, 1, 2, 4, 8] and wide[-1] >= 16, f"k did not double up to k_max: {widths}"
    lone = play(1, accept=0.9, per_row=0.0001, k_max=24)  # 25 rows at k_max: measured at once
    wider = [k for k in lone if k > 1]  # after the first probe's single draft
    assert wider[0] == 24 and lone[-1] == 24, f"a lone stream did not try k_max first: {lone[:20]}"


def test_payoff_guard_discounts_the_eager_first_steps_of_a_shape():
    """A new row count's first two steps run eagerly (replay warms up, then records) at
    several times its later cost: an exploration measured by them alone would never look
    worth it, so k must still reach k_max for a lone stream with good drafts."""
    assert min(play(1, accept=0.8, per_row=0.0005, eager_first=2)[-100:]) == 4


def test_payoff_guard_values_later_drafts_by_their_own_acceptance():
    """First drafts accepted 0.6 of the time, later ones 0.95 given the one before (n-gram
    drafts on a grounded text look like this): with a step costing 12 ms + 2 ms per draft,
    5 drafts pay best (E(5) = 3.7 tokens in 22 ms); a geometric model from the first
    draft alone (E(5) = 2.4) would settle on 2. Without deeper verdicts the guard keeps the
    geometric model."""
    def guard_after(deeper):
        guard = PayoffGuard(k_max=5)
        guard.steps = guard.last_try = 1000  # no exploration due
        for _ in range(PayoffGuard.WARMUP + PayoffGuard.TRUSTED + 1):
            for rows in range(1, 7):
                guard.record_step(rows, 0.010 + 0.002 * rows)
        guard.record_acceptance(100, 60, deeper)
        return guard
    later = [(60, 57), (57, 54), (54, 51), (51, 48)]
    guard = guard_after(later)
    assert abs(guard.expected_tokens(2) - (1 + 0.6 + 0.6 * 0.95)) < 1e-9
    assert guard.drafts(1) == 5, "later drafts accepted 0.95: all five pay"
    assert guard_after(()).drafts(1) == 2, "the geometric model (first-draft acceptance only)"
    assert guard_after(later[:1]).expected_tokens(5) == pytest.approx(1 + 0.6 * sum(0.95 ** i for i in range(5)))
    # a verdict not renewed for STALE steps is not trusted: the geometric model again, so a
    # guard that came to draft little is not held there by an old low verdict
    low = guard_after([(60, 6)])
    assert low.drafts(1) <= 1
    low.steps += PayoffGuard.STALE + 1
    assert low.expected_tokens(5) == pytest.approx(sum(0.6 ** i for i in range(6)))


def test_payoff_guard_lone_stream_drafts_again_for_a_new_request():
    """A lone stream whose first request's drafts all failed (a greeting) has come to draft
    nothing; the next request (a code edit whose drafts are accepted 0.9) must be drafted
    for within a few steps of starting, not after hundreds of doubling probe intervals."""
    guard = PayoffGuard(k_max=5)
    k = 0
    for _ in range(300):  # request 1: every draft rejected
        guard.record_step(1 + k, 0.010 + 0.0005 * (1 + k))
        if k:
            guard.record_acceptance(1, 0, [(0, 0)] * (k - 1))
        k = guard.drafts(1)
    assert guard.accept < 0.1 and k <= 1
    guard.request_started(1)  # request 2 starts decoding
    chosen = []
    for _ in range(20):
        guard.record_step(1 + k, 0.010 + 0.0005 * (1 + k))
        if k:
            guard.record_acceptance(1, 1, [(1, 1)] * (k - 1))
        k = guard.drafts(1)
        chosen.append(k)
    assert chosen[0] >= 1 and chosen[-1] == 5, f"request 2 was drafted for as {chosen}"
    # in a wide batch one more request says little: the estimate stays where it was
    wide = PayoffGuard(k_max=5)
    wide.accept = 0.05
    wide.request_started(32)
    assert wide.accept == 0.05


def test_payoff_guard_tries_a_stale_row_count_again():
    """A row count measured slow long ago (its first steps ran on a busy machine) and never
    chosen since is tried again after COST_STALE steps, and its new time replaces the old
    average: the guard moves to the k that pays instead of keeping the old verdict."""
    guard = PayoffGuard(k_max=5)
    for _ in range(PayoffGuard.WARMUP + PayoffGuard.TRUSTED + 1):
        guard.record_step(1, 0.010)
        guard.record_step(6, 0.060)  # measured 6x a one-row step: drafting 5 does not pay
    guard.record_acceptance(1, 1, [(1, 1)] * 4)
    guard.deeper = {p: [0.95, 10 ** 9] for p in range(2, 6)}  # kept fresh for this test
    assert guard.drafts(1) < 5
    chosen = []
    for _ in range(PayoffGuard.COST_STALE + 20):
        k = guard.drafts(1)
        chosen.append(k)
        guard.record_step(1 + k, 0.010 + 0.001 * k)  # the machine as it is now: 1 ms per draft
    assert 5 in chosen[PayoffGuard.COST_STALE - 10:] and chosen[-1] == 5, f"k stayed at {sorted(set(chosen))}"


def test_position_verdicts():
    """Four requests' (drafts verified, drafts accepted): the first drafts' verdicts, then
    per later position how many drafts reached it and how many were accepted there."""
    first, deeper = position_verdicts([(3, 3), (3, 1), (2, 0), (5, 2)])
    assert first == 3
    # position 2: reached by (3,3), (3,1), (5,2) (draft 1 accepted; (2,0) stopped at 1), accepted by (3,3), (5,2)
    # position 3: reached by (3,3), (5,2), accepted by (3,3); positions 4, 5: reached by none
    assert deeper == [(3, 2), (2, 1), (0, 0), (0, 0)]
    assert position_verdicts([]) == (0, [])


def test_payoff_guard_probes_less_often_while_drafting_does_not_pay():
    """Acceptance probes (one draft, flagged `probing`) come every PROBE steps at first,
    then at doubling intervals up to MAX_PROBE while they find nothing that pays."""
    guard = PayoffGuard(k_max=5)
    probes, k = [], 0
    for step in range(1, 3000):
        guard.record_step(32 * (1 + k), 0.010 + 0.002 * 32 * (1 + k))
        if k:
            guard.record_acceptance(32, 0)
        k = guard.drafts(32)
        if guard.probing:
            assert k == 1
            probes.append(step)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:5] == [32, 64, 128, 256, 512] and set(gaps[5:]) == {512}, f"probe intervals {gaps}"


def test_spec_stats():
    stats = SpecStats()
    stats.record(3, 2)
    stats.record(3, 0)
    stats.record(0, 0)  # a step without drafts is no draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 2)
    assert stats.accepted_per_position == [1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(1 / 3)
    assert stats.mean_acceptance_length == pytest.approx(2.0)


def test_draft_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    other = tiny_model_dir("llama", vocab_size=640)
    with pytest.raises(ValueError, match="vocab_size 640"):
        LLM(str(target), kv_cache_memory=1 << 24, speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_draft_of_another_architecture_and_size(tiny_model_dir):
    """A draft smaller than the target (other depth, width and architecture, same
    tokenizer) still leaves the greedy output unchanged."""
    target = tiny_model_dir("llama")
    draft = tiny_model_dir("qwen2", num_hidden_layers=1, hidden_size=32, intermediate_size=64, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ids = [{"prompt_token_ids": [5, 6, 7, 8] * 4}, {"prompt_token_ids": [9, 3, 200]}]
    base = [o.outputs[0].token_ids for o in LLM(str(target), kv_cache_memory=1 << 24).generate(ids, params)]
    engine = LLM(str(target), kv_cache_memory=1 << 24,
                 speculative_config={"model": str(draft), "num_speculative_tokens": 3, "adaptive": False})
    assert [o.outputs[0].token_ids for o in engine.generate(ids, params)] == base
    assert engine.engine.scheduler.spec_stats.num_drafts > 0


def test_verify_steps_are_replayed_on_the_cpu(tiny_model_dir):
    """Step replay captures verify steps (1 + k query rows per request), not only decodes."""
    model = tiny_model_dir("llama")
    engine = LLM(str(model), kv_cache_memory=1 << 24,
                 speculative_config={"model": str(model), "num_speculative_tokens": 3, "adaptive": False})
    engine.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    runner = engine.engine.worker.graph_runner
    assert runner is not None and not runner.off
    recorded = [key for key, graph in runner.graphs.items() if graph is not None and graph.verified]
    shapes = [dict((name, shape) for name, shape, *_ in key if isinstance(name, str) and name == "input_ids")
              for key in recorded]
    assert any(s.get("input_ids") == (4,) for s in shapes), f"no 4-row verify step was replayed: {shapes}"
