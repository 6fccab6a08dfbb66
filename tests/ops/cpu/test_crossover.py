"""Measured kernel crossovers (ops/cpu/crossover.py): the answer follows the timings, it
is cached on disk per machine and thread count, and a small kernel that always wins
gives NEVER."""

from __future__ import annotations

import json
import time

import pytest
import torch

from pagedllm.ops.cpu import crossover


def sleeper(per_row_s: float, fixed_s: float):
    def kernel(x: torch.Tensor) -> torch.Tensor:
        time.sleep(fixed_s + per_row_s * x.shape[0])
        return x
    return kernel


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    crossover.forget()
    yield tmp_path
    crossover.forget()


def test_large_kernel_takes_over_where_it_becomes_faster():
    # small: 1 ms per row; large: 6 ms flat -> large wins from 8 rows (8 ms > 6 ms)
    rows = crossover.measure(sleeper(1e-3, 0), sleeper(0, 6e-3), k=4, candidates=(1, 2, 4, 8, 16), budget_s=0)
    assert rows == 8


def test_a_small_kernel_that_always_wins_gives_never():
    rows = crossover.measure(sleeper(0, 0), sleeper(0, 2e-3), k=4, candidates=(1, 2, 4), budget_s=0)
    assert rows == crossover.NEVER


def test_answers_are_cached_on_disk_per_machine(fresh_cache):
    calls = []

    def small(x):
        calls.append(x.shape[0])
        time.sleep(1e-3 * x.shape[0])
        return x

    first = crossover.rows_from("test-pair|4x4", small, sleeper(0, 3e-3), 4)
    assert calls, "the first ask must measure"
    data = json.loads((fresh_cache / "crossovers.json").read_text())
    (key, value), = data.items()
    assert key.endswith("|test-pair|4x4") and f"threads={torch.get_num_threads()}" in key and value == first
    crossover.forget()
    calls.clear()
    assert crossover.rows_from("test-pair|4x4", small, sleeper(0, 3e-3), 4) == first
    assert not calls, "a cached answer must not be measured again"


def test_a_first_row_question_times_only_the_rows_it_asks_and_is_cached_apart(fresh_cache):
    """A caller asking only whether `large` wins from the first row times rows 1 and 2 (a
    cold start-up timed up to 64 rows per layer shape for nothing), and its answer, cut
    short at 2, is never read as the full search's."""
    timed = []

    def small(x):
        timed.append(x.shape[0])
        time.sleep(1e-3 * x.shape[0])
        return x

    short = crossover.rows_from("pair|4x4", small, sleeper(0, 20e-3), 4, candidates=(1, 2))
    assert short == crossover.NEVER and set(timed) == {1, 2}, f"timed rows {sorted(set(timed))}"
    timed.clear()
    full = crossover.rows_from("pair|4x4", small, sleeper(0, 20e-3), 4, candidates=(1, 2, 4, 8, 16, 32, 64))
    assert timed, "the full search must not take the short search's cached answer"
    assert full == 32
    keys = sorted(json.loads((fresh_cache / "crossovers.json").read_text()))
    assert len(keys) == 2 and keys[1].endswith("|pair|4x4|rows=1,2"), keys


def test_unreadable_cache_is_ignored(fresh_cache):
    (fresh_cache / "crossovers.json").write_text("{not json")
    assert crossover.rows_from("pair|1x1", sleeper(0, 0), sleeper(0, 1e-3), 4) == crossover.NEVER


def counted_copies(calls: list[str], nbytes: int, side: str = "") -> crossover.Contender:
    """A contender whose kernel and each of its copies log their name (after `side`) when called."""
    def named(name: str):
        def kernel(x: torch.Tensor) -> torch.Tensor:
            calls.append(side + name)
            return x
        return kernel

    made = iter(range(1, 1000))
    return crossover.Contender(named("serving"), lambda: named(f"copy{next(made)}"), nbytes)


@pytest.mark.parametrize("reported_llc, ring", [(0, 16 << 20), (32 << 20, 32 << 20), (480 << 20, 128 << 20)])
def test_a_ring_is_the_reported_cache_within_bounds(monkeypatch, reported_llc, ring):
    """The last-level cache, at least 16 MiB, and at most MAX_RING_BYTES: a VM that reports its
    host's 480 MiB cache must not build (and first-touch) ~1 GiB of weight copies per side."""
    monkeypatch.setattr(crossover, "last_level_cache_bytes", lambda: reported_llc)
    assert crossover.ring_bytes() == ring


def test_a_timing_walks_rings_of_copies_holding_the_last_level_cache(monkeypatch):
    """Weights come from memory in a step: each side is timed over a ring of copies whose
    bytes add up to ring_bytes(), the serving kernel among them, every one called, in ring
    order, a segment per pass, each pass going on where that side's last one stopped (so a
    copy's calls lie a whole walk of both rings apart)."""
    monkeypatch.setattr(crossover, "ring_bytes", lambda: 10_000)
    monkeypatch.setattr(crossover, "DECISIVE", float("inf"))  # two no-op kernels: never a decisive gap
    small_calls, large_calls = [], []
    crossover.measure(counted_copies(small_calls, 1_000), counted_copies(large_calls, 2_500), k=4,
                      candidates=(1, 2), budget_s=0)
    small_ring = ["serving"] + [f"copy{i}" for i in range(1, 10)]  # 10 x 1000 bytes
    large_ring = ["serving"] + [f"copy{i}" for i in range(1, 4)]  # 4 x 2500 bytes
    # per row count a warm-up pass and PASSES timed ones; a pass calls a quarter of the ring
    small_passes = 2 * (1 + crossover.PASSES) * -(-10 // crossover.SEGMENTS)
    assert small_calls == [small_ring[i % 10] for i in range(small_passes)], small_calls
    assert large_calls == [large_ring[i % 4] for i in range(2 * (1 + crossover.PASSES))], large_calls


def test_a_pass_times_one_segment_of_each_ring_in_turn(monkeypatch):
    """The sides alternate segment by segment: a drift meets both, and between two calls of one
    copy the walks have read the rest of both rings."""
    monkeypatch.setattr(crossover, "ring_bytes", lambda: 8_000)
    monkeypatch.setattr(crossover, "SEGMENTS", 4)
    monkeypatch.setattr(crossover, "DECISIVE", float("inf"))
    calls = []
    crossover.measure(counted_copies(calls, 1_000, "small:"), counted_copies(calls, 1_000, "large:"), k=4,
                      candidates=(1,), budget_s=0)
    # rings of 8 copies: each pass calls two copies of one ring, then two of the other
    assert calls[:8] == ["small:serving", "small:copy1", "large:serving", "large:copy1",
                         "small:copy2", "small:copy3", "large:copy2", "large:copy3"], calls
    assert len(calls) == 2 * 2 * (1 + crossover.PASSES)


def test_past_64_rows_a_pass_takes_a_shorter_segment_of_each_ring(monkeypatch):
    """A 256-row call is arithmetic more than reads: its passes take a quarter of the usual
    segment on both sides (the same fraction of each ring, so the walks still alternate over
    whole rings), not four times the work per pass."""
    monkeypatch.setattr(crossover, "ring_bytes", lambda: 32_000)
    monkeypatch.setattr(crossover, "SEGMENTS", 4)
    monkeypatch.setattr(crossover, "DECISIVE", float("inf"))
    calls = []
    crossover.measure(counted_copies(calls, 1_000, "small:"), counted_copies(calls, 2_000, "large:"), k=4,
                      candidates=(64, 256), budget_s=0)
    rounds = 1 + crossover.PASSES  # a warm-up and the timed passes of each side
    at_64, at_256 = calls[:rounds * (8 + 4)], calls[rounds * (8 + 4):]
    assert at_64[:12] == [f"small:{n}" for n in ["serving"] + [f"copy{i}" for i in range(1, 8)]] + \
        ["large:serving", "large:copy1", "large:copy2", "large:copy3"], at_64[:12]
    # rings of 32 and 16 copies: 8 and 4 calls a pass at 64 rows, 2 and 1 at 256
    assert len(at_256) == rounds * (2 + 1), len(at_256)
    assert at_256[:3] == ["small:copy8", "small:copy9", "large:copy4"], at_256[:3]


def test_a_weight_past_the_ring_size_is_timed_alone_and_copies_are_capped(monkeypatch):
    monkeypatch.setattr(crossover, "ring_bytes", lambda: 10_000)
    big, tiny = [], []
    tiny_side = counted_copies(tiny, 1)
    crossover.measure(counted_copies(big, 50_000), tiny_side, k=4, candidates=(1,), budget_s=0)
    assert set(big) == {"serving"}, "a weight larger than the ring streams from memory by itself"
    assert len(tiny_side.copies) + 1 == crossover.MAX_COPIES


def test_a_contender_builds_its_copies_once_for_every_contest_it_enters(monkeypatch):
    """A layer's winning kernel meets its rivals in turn: its ring of copies is built for the
    first contest and reused (building the copies was ~0.3 s of a first start-up), and
    clearing `copies` frees them."""
    monkeypatch.setattr(crossover, "ring_bytes", lambda: 10_000)
    built = []

    def copy():
        built.append(1)
        return lambda x: x

    winner = crossover.Contender(lambda x: x, copy, 1_000)
    for rival in range(3):
        crossover.measure(winner, counted_copies([], 2_500), k=4, candidates=(1,), budget_s=0)
    assert len(built) == 9, f"10 x 1000 bytes need 9 copies, built once for three contests: built {len(built)}"
    winner.copies.clear()
    crossover.measure(winner, counted_copies([], 2_500), k=4, candidates=(1,), budget_s=0)
    assert len(built) == 18, "after clearing, the next contest builds the ring again"


def test_the_two_sides_are_timed_in_alternating_passes(monkeypatch):
    """A drift of the machine's speed must meet both sides alike: passes alternate
    small, large, small, ... instead of all of one side's, then the other's."""
    monkeypatch.setattr(crossover, "DECISIVE", float("inf"))  # no-op kernels' timings are noise
    order = []

    def side(name):
        def kernel(x):
            order.append(name)
            return x
        return kernel

    crossover.measure(side("small"), side("large"), k=4, candidates=(1,), budget_s=0)
    assert order == ["small", "large"] * (1 + crossover.PASSES), order


def test_a_decisive_gap_is_timed_once_and_a_close_call_in_full():
    """After the warm-up and one alternating round, a side DECISIVE times faster has won
    that row count (the further rounds cost a first start-up seconds); a close call gets
    all PASSES rounds."""
    def timed(costs_s):
        order = []

        def side(name, cost_s):
            def kernel(x):
                order.append(name)
                time.sleep(cost_s)
                return x
            return kernel

        crossover.measure(side("small", costs_s[0]), side("large", costs_s[1]), k=4, candidates=(1,), budget_s=0)
        return order

    assert timed((8e-3, 1e-3)) == ["small", "large"] * 2, "8x apart: a warm-up and one round"
    assert timed((1.1e-3, 1e-3)) == ["small", "large"] * (1 + crossover.PASSES), "1.1x apart: every round"


def test_a_drift_during_the_timing_does_not_decide():
    """The machine slows down 3x halfway through a candidate's timing: the side timed
    second must not lose for it (the large kernel is 1.2x faster throughout)."""
    clock = {"calls": 0}

    def side(cost_s):
        def kernel(x):
            clock["calls"] += 1
            time.sleep(cost_s * (3.0 if clock["calls"] > 4 else 1.0))
            return x
        return kernel

    rows = crossover.measure(side(1.2e-3), side(1.0e-3), k=4, candidates=(1,), budget_s=0)
    assert rows == 1, "the large kernel is faster at every moment; alternating passes see it"


def test_known_answers_only_what_was_measured(fresh_cache):
    assert crossover.known("pair|2x2", (1, 2)) is None, "nothing measured yet"
    rows = crossover.rows_from("pair|2x2", sleeper(0, 0), sleeper(0, 5e-3), 4, candidates=(1, 2))
    assert crossover.known("pair|2x2", (1, 2)) == rows
    assert crossover.known("pair|2x2") is None, "the full search was never measured"
    crossover.forget()
    assert crossover.known("pair|2x2", (1, 2)) == rows, "the disk cache answers after the memo is gone"
