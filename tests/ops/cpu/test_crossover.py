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


def test_unreadable_cache_is_ignored(fresh_cache):
    (fresh_cache / "crossovers.json").write_text("{not json")
    assert crossover.rows_from("pair|1x1", sleeper(0, 0), sleeper(0, 1e-3), 4) == crossover.NEVER
