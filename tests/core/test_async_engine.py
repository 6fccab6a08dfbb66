"""AsyncLLMEngine: the engine thread builds the engine it steps.

Why it matters: libgomp keeps one OpenMP thread pool per thread that opens parallel
regions. An engine loaded on the server's main thread and stepped on the engine thread
left two pools, so libgomp counted more OpenMP threads than CPUs and stopped
spin-waiting at barriers: every kernel of a step ended in a futex sleep and wake-up.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.core.engine import AsyncLLMEngine, LLMEngine
from pagedllm.core.request import SamplingParams


def _config(model: str) -> EngineConfig:
    return EngineConfig.from_kwargs(model=model, kv_cache_memory=8 << 20, device="cpu", seed=0)


def _generate(engine: AsyncLLMEngine, ids: list[int]) -> list[int]:
    async def run() -> list[int]:
        final = None
        async for out in engine.generate(None, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                         prompt_token_ids=ids):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    return asyncio.run(run())


def test_the_engine_thread_builds_and_steps_the_engine(tiny_model_dir: Callable[..., Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(str(tiny_model_dir("llama")))
    built_on: list[threading.Thread] = []
    stepped_on: set[threading.Thread] = set()
    step = LLMEngine.step

    def recording_step(self: LLMEngine) -> Any:
        stepped_on.add(threading.current_thread())
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", recording_step)

    def build() -> LLMEngine:
        built_on.append(threading.current_thread())
        return LLMEngine(config)

    engine = AsyncLLMEngine(build)
    try:
        assert len(_generate(engine, [5, 6, 7])) == 4
    finally:
        engine.shutdown()
    assert built_on and built_on[0] is not threading.main_thread(), "the engine was built on the caller's thread"
    assert stepped_on == {built_on[0]}, "steps ran on a thread other than the one that built the engine"


def test_from_config_builds_on_the_engine_thread(tiny_model_dir: Callable[..., Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(str(tiny_model_dir("llama")))
    built_on: list[threading.Thread] = []
    init = LLMEngine.__init__

    def recording_init(self: LLMEngine, *args: Any, **kwargs: Any) -> None:
        built_on.append(threading.current_thread())
        init(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    engine = AsyncLLMEngine.from_config(config)
    try:
        assert built_on == [engine._thread]
    finally:
        engine.shutdown()


def test_a_build_error_is_raised_by_the_constructor() -> None:
    def build() -> LLMEngine:
        raise ValueError("no such model: /nowhere")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLMEngine(build)


def test_a_built_engine_is_still_accepted(tiny_model_dir: Callable[..., Any]) -> None:
    core = LLMEngine(_config(str(tiny_model_dir("llama"))))
    engine = AsyncLLMEngine(core)
    try:
        assert engine.engine is core
        assert len(_generate(engine, [9, 10])) == 4
    finally:
        engine.shutdown()


def _first_step_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records how many requests each step of an LLMEngine ran (appended as it starts)."""
    sizes: list[int] = []
    step = LLMEngine.step

    def recording_step(self: LLMEngine) -> Any:
        sizes.append(len(self.scheduler.waiting) + len(self.scheduler.running))
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", recording_step)
    return sizes


def _burst(engine: AsyncLLMEngine, n: int, work_s: float, block_s: float = 0.0) -> None:
    """n requests handed over one per event-loop turn, each after `work_s` of blocking
    work (a server parsing and tokenizing them); then the loop blocks `block_s`."""
    import time

    async def one(i: int) -> None:
        async for _ in engine.generate(None, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                       prompt_token_ids=[5 + i, 6, 7]):
            pass

    async def run() -> None:
        tasks = []
        for i in range(n):
            time.sleep(work_s)
            tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.sleep(0)
        time.sleep(block_s)
        await asyncio.gather(*tasks)

    asyncio.run(run())


def test_an_idle_engine_lets_a_burst_finish_arriving(tiny_model_dir: Callable[..., Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Six requests handed over ~1 ms apart reach one first step: an idle engine lets the
    event loop turn until rounds of turns bring nothing new (at most SETTLE_LIMIT_S),
    instead of taking the cores for the first request alone."""
    engine = AsyncLLMEngine(LLMEngine(_config(str(tiny_model_dir("llama")))))
    sizes = _first_step_sizes(monkeypatch)  # after the start-up warm-up's steps
    try:
        _burst(engine, 6, work_s=0.001)
    finally:
        engine.shutdown()
    assert sizes and sizes[0] == 6, f"the first step ran {sizes[0] if sizes else 0} of the burst's 6 requests"


def test_a_busy_event_loop_delays_the_first_step_by_the_limit_only(tiny_model_dir: Callable[..., Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An event loop that does not turn (blocked 1 s after handing over a request) holds
    the engine back SETTLE_LIMIT_S, not until it turns again."""
    import time

    from pagedllm.core import engine as engine_module

    starts: list[float] = []
    step = LLMEngine.step

    def timed_step(self: LLMEngine) -> Any:
        starts.append(time.monotonic())
        return step(self)

    engine = AsyncLLMEngine(LLMEngine(_config(str(tiny_model_dir("llama")))))
    monkeypatch.setattr(LLMEngine, "step", timed_step)  # after the start-up warm-up's steps
    try:
        begun = time.monotonic()
        _burst(engine, 1, work_s=0.0, block_s=1.0)
    finally:
        engine.shutdown()
    limit = engine_module.SETTLE_LIMIT_S
    assert starts and starts[0] - begun < 0.5, \
        f"the first step began {starts[0] - begun:.2f} s in, waiting on a blocked loop (limit {limit} s)"


def test_warm_up_prefills_one_budget_of_dummy_prompts_and_leaves_no_trace(tiny_model_dir: Callable[..., Any],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up warm-up is one prefill step of the dummy prompts together; afterwards no
    request, block or counter remains, and a request gets the tokens a fresh engine gives."""
    warmed = LLMEngine(_config(str(tiny_model_dir("llama"))))
    fresh = LLMEngine(_config(str(tiny_model_dir("llama"))))
    steps = _first_step_sizes(monkeypatch)  # only `warmed` steps before the assertion on them
    free_before = warmed.block_manager.num_free_blocks
    assert warmed.warm_up(256, prompt_len=32) == 256
    assert steps == [8], f"the warm-up ran steps over {steps} requests, not one step of its 8 prompts"
    assert not warmed.parents and not warmed.has_unfinished_requests()
    assert warmed.block_manager.num_free_blocks == free_before, "the warm-up's blocks were not given back"
    assert warmed.stats.num_steps == 0 and warmed.stats.num_prompt_tokens == 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for engine in (warmed, fresh):
        engine.add_request("r", None, params, prompt_token_ids=[3, 1, 4, 1, 5, 9, 2, 6])
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs.append(list(out.outputs[0].token_ids))
    assert outputs[0] == outputs[1], "a request after the warm-up got other tokens than on a fresh engine"


def test_the_engine_thread_warms_up_before_it_serves(tiny_model_dir: Callable[..., Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[str, threading.Thread]] = []
    warm_up, step = LLMEngine.warm_up, LLMEngine.step

    def recording_warm_up(self: LLMEngine, *args: Any, **kwargs: Any) -> int:
        order.append(("warm_up", threading.current_thread()))
        return warm_up(self, *args, **kwargs)

    def recording_step(self: LLMEngine) -> Any:
        order.append(("step", threading.current_thread()))
        return step(self)

    monkeypatch.setattr(LLMEngine, "warm_up", recording_warm_up)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    engine = AsyncLLMEngine.from_config(_config(str(tiny_model_dir("llama"))))
    try:
        assert len(_generate(engine, [5, 6, 7])) == 4
    finally:
        engine.shutdown()
    assert order and order[0][0] == "warm_up", "the engine stepped a request before its warm-up"
    assert {thread for _, thread in order} == {order[0][1]}, "the warm-up ran on another thread than the steps"
