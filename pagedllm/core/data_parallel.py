"""Data parallelism: N engine replicas behind one server.

Each replica is a whole engine (its own scheduler, KV cache and, with tensor or
pipeline parallelism, its own ranks) on its own share of the machine: replica i takes
the GPUs, or the share of the CPUs, after replica i - 1's (`ParallelConfig.local_rank`).
`DataParallelEngine` offers the server the interface of one `AsyncLLMEngine` and sends
each request to the replica with the fewest requests in flight; a request stays on its
replica until it ends. Replicas run in this process, each with its own engine thread:
the model's work runs in torch, outside the interpreter lock.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, AsyncIterator, Callable

from pagedllm.core import heap
from pagedllm.core.config import EngineConfig
from pagedllm.core.engine import AsyncLLMEngine, LLMEngine
from pagedllm.core.executor import EngineDeadError
from pagedllm.core.request import RequestOutput, SamplingParams

logger = logging.getLogger("pagedllm")


class DataParallelEngine:
    def __init__(self, replicas: list[AsyncLLMEngine]) -> None:
        self.replicas = replicas
        self._in_flight = [0] * len(replicas)
        self._owner: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: EngineConfig) -> "DataParallelEngine":
        replicas: list[AsyncLLMEngine] = []
        try:
            with heap.built_once():  # every replica's heap frozen together (core/heap.py)
                for i in range(config.parallel.data_parallel_size):
                    replica = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                                       data_parallel_rank=i))
                    replicas.append(AsyncLLMEngine(functools.partial(LLMEngine, replica)))
                    logger.info("data-parallel replica %d of %d ready", i + 1, config.parallel.data_parallel_size)
        except BaseException:
            for replica in replicas:
                replica.shutdown()
            raise
        return cls(replicas)

    @property
    def engine(self) -> LLMEngine:
        """The first replica's engine: what the server reads of the model (tokenizer,
        lengths, validation), the same in every replica."""
        return self.replicas[0].engine

    @property
    def engines(self) -> list[LLMEngine]:
        return [r.engine for r in self.replicas]

    async def generate(self, prompt: str | None, params: SamplingParams, request_id: str | None = None,
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        index = min(range(len(self.replicas)), key=self._in_flight.__getitem__)
        self._in_flight[index] += 1
        stream = self.replicas[index].generate(prompt, params, request_id, prompt_token_ids)
        if request_id is not None:
            self._owner[request_id] = index
        try:
            async for out in stream:  # an id-less request is aborted on every replica (it is unknown to the others)
                yield out
        finally:
            self._in_flight[index] -= 1
            self._owner.pop(request_id, None)
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        index = self._owner.get(request_id)
        for i, replica in enumerate(self.replicas):
            if index is None or i == index:
                replica.abort(request_id)

    def abort_all(self, error: Callable[[], BaseException]) -> int:
        return sum(r.abort_all(error) for r in self.replicas)

    @property
    def is_alive(self) -> bool:
        return all(r.is_alive for r in self.replicas)

    @property
    def dead_error(self) -> EngineDeadError | None:
        return next((r.dead_error for r in self.replicas if r.dead_error is not None), None)

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()


def async_engine(config: EngineConfig) -> Any:
    """The engine a server runs: one AsyncLLMEngine, or replicas behind one interface."""
    if config.parallel.data_parallel_size > 1:
        return DataParallelEngine.from_config(config)
    return AsyncLLMEngine.from_config(config)
