"""PAGEDLLM_CPU_OMP_THREADS_BIND (core/cpu_threads.py): CPU lists, pinning, and the
errors a bad value gives."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.core import cpu_threads


def test_cpu_lists_parse_and_bad_ones_are_named():
    assert cpu_threads.parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert cpu_threads.parse_cpu_list("1") == [1]
    for bad, why in [("a-b", "not a CPU number"), ("3-1", "backwards"), ("0,,1", "not a CPU number")]:
        with pytest.raises(ValueError, match=why):
            cpu_threads.parse_cpu_list(bad)


@pytest.fixture
def restore():
    threads, mask = torch.get_num_threads(), os.sched_getaffinity(0)
    yield
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, mask)


def test_a_list_pins_the_process_with_a_thread_per_cpu(restore):
    first = min(os.sched_getaffinity(0))
    said = cpu_threads.apply(str(first))
    assert os.sched_getaffinity(0) == {first} and torch.get_num_threads() == 1
    assert f"pinned to CPUs {first}" in said


def test_auto_caps_threads_at_the_available_cpus(restore):
    torch.set_num_threads(len(os.sched_getaffinity(0)) + 3)
    cpu_threads.apply("auto")
    assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    torch.set_num_threads(1)
    assert "1 threads" in cpu_threads.apply(None) and torch.get_num_threads() == 1, "auto keeps a smaller count"
    assert "nobind" in cpu_threads.apply("nobind")


def test_unavailable_cpus_and_per_rank_lists_fail_fast(restore):
    beyond = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"CPUs {beyond} are not available"):
        cpu_threads.apply(str(beyond))
    with pytest.raises(ValueError, match="one list per rank"):
        cpu_threads.apply("0|1")
