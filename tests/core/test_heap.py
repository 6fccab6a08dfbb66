"""An engine's start-up heap is frozen out of the cycle collector's walks (core/heap.py),
and what a dropped engine leaves in cycles is still reclaimed."""

from __future__ import annotations

import gc
import weakref

import pytest

from pagedllm import LLM
from pagedllm.core import heap


@pytest.fixture(autouse=True)
def _first_build(monkeypatch):
    """Each test starts as a fresh process would: nothing frozen, no build before."""
    enabled = gc.isenabled()
    gc.unfreeze()
    monkeypatch.setattr(heap, "_froze", [False])
    yield
    gc.unfreeze()
    gc.enable() if enabled else gc.disable()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_built_engine_is_frozen_with_the_collector_on(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir("llama")), max_model_len=64, kv_cache_memory=1 << 22)
    assert gc.isenabled(), "the collector stayed paused after the engine was built"
    model = llm.engine.worker.model
    assert gc.get_freeze_count() > 0, "nothing was frozen after the build"
    assert not any(o is model for o in gc.get_objects()), "the engine's model is still walked"
    llm.engine.shutdown()
    assert gc.get_freeze_count() == 0, "shutdown left the heap frozen"


def test_a_later_build_hands_a_dropped_engine_back_to_the_collector(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    first = LLM(model=path, max_model_len=64, kv_cache_memory=1 << 22)
    first.engine.worker.model.cycle = _Cycle()  # the model now sits in a garbage cycle once dropped
    first.engine.worker.model.cycle.model = first.engine.worker.model
    gone = weakref.ref(first.engine.worker.model)
    del first
    gc.collect()
    assert gone() is not None, "test premise: the first engine's cycle is frozen, out of the collector's reach"
    second = LLM(model=path, max_model_len=64, kv_cache_memory=1 << 22)
    assert gc.get_freeze_count() == 0, "a later build froze again (it would freeze dropped engines' cycles too)"
    gc.collect()
    assert gone() is None, "the dropped engine's cycle stayed frozen after a later build (a leak)"
    second.engine.shutdown()


def test_replicas_built_inside_one_block_are_frozen_together():
    with heap.built_once():
        outer = _Cycle()
        with heap.built_once():  # a replica's own build: the outer block's
            inner = _Cycle()
        assert not gc.isenabled(), "an inner build turned the collector back on"
    frozen = gc.get_freeze_count()
    assert frozen > 0 and not any(o is outer or o is inner for o in gc.get_objects())


def test_a_failed_build_freezes_nothing_and_turns_the_collector_back_on():
    with pytest.raises(RuntimeError, match="boom"):
        with heap.built_once():
            assert not gc.isenabled(), "the collector runs during the build"
            raise RuntimeError("boom")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_caller_that_turned_the_collector_off_keeps_it_off():
    gc.disable()
    with heap.built_once():
        pass
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_the_process_exits_unfrozen():
    import subprocess
    import sys

    code = ("import atexit, gc\n"
            "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))  # runs last\n"
            "from pagedllm.core import heap\n"
            "with heap.built_once():\n"
            "    pass\n"
            "assert gc.get_freeze_count() > 0\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "frozen at exit: 0" in out.stdout, f"the heap stayed frozen at exit: {out.stdout!r}"
