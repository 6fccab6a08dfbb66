"""PAGEDLLM_CPU_MALLOC_REUSE_MB: glibc's mmap and trim thresholds, raised for CPU engines."""

from __future__ import annotations

import pytest

from pagedllm.core import cpu_allocator, envs


class FakeLibc:
    def __init__(self, accepts: bool = True) -> None:
        self.accepts = accepts
        self.calls: list[tuple] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return int(self.accepts)

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


@pytest.fixture
def libc(monkeypatch):
    fake = FakeLibc()
    monkeypatch.setattr(cpu_allocator, "_glibc", lambda: fake)
    return fake


def test_default_raises_both_thresholds_to_a_gib(libc):
    assert "1024 MiB" in cpu_allocator.apply(None)
    assert libc.calls == [("mallopt", -3, 1 << 30), ("mallopt", -1, 1 << 30)]


def test_a_value_sets_that_many_mib_and_zero_leaves_glibc_alone(libc):
    cpu_allocator.apply("64")
    assert libc.calls == [("mallopt", -3, 64 << 20), ("mallopt", -1, 64 << 20)]
    libc.calls.clear()
    assert "glibc's defaults" in cpu_allocator.apply("0") and libc.calls == []


def test_refusals_and_other_c_libraries_change_nothing(monkeypatch, libc):
    libc.accepts = False
    assert "refused" in cpu_allocator.apply(None)
    monkeypatch.setattr(cpu_allocator, "_glibc", lambda: None)
    assert "no glibc" in cpu_allocator.apply(None)
    cpu_allocator.release_free()  # nothing to call: no error


def test_release_free_trims_the_heap(libc):
    cpu_allocator.release_free()
    assert libc.calls == [("malloc_trim", 0)]


def test_this_machines_glibc_takes_the_default():
    if cpu_allocator._glibc() is None:
        pytest.skip("not glibc")
    assert "are reused" in cpu_allocator.apply(None)


def test_a_bad_value_is_refused_before_anything_loads(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_MALLOC_REUSE_MB", "lots")
    assert any("PAGEDLLM_CPU_MALLOC_REUSE_MB" in p for p in envs.check_values())
