"""Server fixtures: a real uvicorn on 127.0.0.1 (random free port) in a background thread.

The server runs in this process so tests can look at the engine behind it (block
usage, batch sizes) and inject engine faults; clients still talk to it over TCP, as
the official `openai` client and httpx do in production.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import httpx
import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.core.data_parallel import async_engine
from pagedllm.core.engine import AsyncLLMEngine
from pagedllm.server.app import ServerSettings, build_app, uvicorn_options
from tests._uvicorn import serve_in_thread

MODEL_NAME = "tiny"
API_KEY = "test-key"


@dataclass
class LiveServer:
    url: str
    engine: AsyncLLMEngine
    api_key: str | None
    model: str = MODEL_NAME

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, with_key: bool = True, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 30)
        return httpx.Client(base_url=self.url, headers=self.headers if with_key else {}, **kwargs)

    def openai(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=30)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until the engine holds no request (finished or aborted everywhere)."""
        core = self.engine.engine
        deadline = time.monotonic() + timeout
        while core.has_unfinished_requests() or core.num_running or core.num_waiting:
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy: {core.num_running} running, {core.num_waiting} waiting")
            time.sleep(0.02)


@pytest.fixture(scope="session")
def server_model_path(tiny_model_dir: Callable[..., Any]) -> str:
    return str(tiny_model_dir("llama"))


def make_engine(model: str, **overrides: Any) -> AsyncLLMEngine:
    kwargs: dict[str, Any] = dict(model=model, served_model_name=MODEL_NAME, kv_cache_memory=8 << 20,
                                  device="cpu", seed=0)
    kwargs.update(overrides)
    return async_engine(EngineConfig.from_kwargs(**kwargs))


@contextmanager
def live_server(model: str, settings: ServerSettings | None = None, api_key: str | None = None,
                **engine_overrides: Any) -> Iterator[LiveServer]:
    engine = make_engine(model, **engine_overrides)
    try:
        settings = settings or ServerSettings()
        with serve_in_thread(build_app(engine, settings, api_key=api_key), **uvicorn_options(settings)) as url:
            yield LiveServer(url, engine, api_key)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server(server_model_path: str) -> Iterator[LiveServer]:
    """The default server of a test module: tiny model, API key required."""
    with live_server(server_model_path, api_key=API_KEY) as live:
        yield live


@pytest.fixture(scope="session")
def start_server(server_model_path: str) -> Callable[..., Any]:
    """Factory: `with start_server(settings, api_key=..., model=..., **engine_overrides) as live:`
    a server (on the tiny model unless `model` is given), for modules that need other
    settings than `server`'s."""
    def start(settings: ServerSettings | None = None, api_key: str | None = None, model: str | None = None,
              **engine_overrides: Any) -> Any:
        return live_server(model or server_model_path, settings, api_key, **engine_overrides)

    return start
