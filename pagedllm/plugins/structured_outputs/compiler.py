"""Compiling specs off the engine thread: a worker pool, a deadline, an LRU of results.

Every compile is a `CompileJob` in the cache, keyed by (backend, spec): validate waits on
it (at most the timeout), a processor polls it (`ready`/`failure` never block). A job is
kept whether it succeeds or fails, so a repeated invalid schema fails at once and a
compile that timed out still serves the requests after it once it finishes. The clock
starts when the compile itself starts: building a backend's vocabulary (once per engine,
up to a few seconds) and waiting in the pool's queue are not counted, up to a grace.

Native compiles cannot be interrupted: one that times out keeps its worker until it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Sequence

from pagedllm.plugins.structured_outputs.backends import (
    CompiledGrammar,
    GrammarBackend,
    UnsupportedSpec,
    load_backend,
)
from pagedllm.plugins.structured_outputs.spec import PREFIX, CompileSpec

logger = logging.getLogger("pagedllm")

START_GRACE_S = 60.0  # a job may wait this long for a worker and a backend's set-up
CACHE_SIZE = 256


class CompileJob:
    """One spec's compile: a future plus the moment the compile itself started."""

    def __init__(self, spec: CompileSpec, timeout_s: float) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.future: Future = Future()
        self.submitted = time.monotonic()
        self.started: float | None = None
        self._started = threading.Event()

    @classmethod
    def failed(cls, spec: CompileSpec | None, message: str) -> "CompileJob":
        job = cls(spec, 0.0)  # type: ignore[arg-type]
        job.future.set_exception(ValueError(message))
        return job

    def mark_started(self) -> None:
        """Called by the worker when the compile proper begins (again after building a
        fallback backend): the deadline counts from here."""
        self.started = time.monotonic()
        self._started.set()

    def _deadline(self) -> float:
        if self.started is None:
            return self.submitted + START_GRACE_S + self.timeout_s
        return self.started + self.timeout_s

    def _timeout_message(self) -> str:
        return (f"{PREFIX}compiling the {self.spec.description} took longer than compile_timeout_s="
                f"{self.timeout_s:g} s; simplify it, or raise compile_timeout_s in --structured-outputs-config")

    def done(self) -> bool:
        return self.future.done()

    def failure(self) -> str | None:
        """The error (invalid spec, or past the deadline), else None. Never blocks."""
        if self.future.done():
            exc = self.future.exception()
            return None if exc is None else str(exc)
        return self._timeout_message() if time.monotonic() > self._deadline() else None

    def grammar(self) -> CompiledGrammar:
        """The compiled grammar of a job that is done (raises its error otherwise)."""
        return self.future.result(timeout=0)

    def wait(self) -> CompiledGrammar:
        """Block until compiled; ValueError for an invalid spec or a compile past its deadline."""
        while True:
            remaining = self._deadline() - time.monotonic()
            try:
                if self.started is None and not self.future.done():
                    if not self._started.wait(max(0.0, remaining)):
                        raise FutureTimeout
                    continue
                return self.future.result(timeout=max(0.0, remaining))
            except FutureTimeout:
                if self._deadline() - time.monotonic() > 0:  # the clock restarted meanwhile
                    continue
                raise ValueError(self._timeout_message()) from None


class Compiler:
    """The backends of one engine (built on first use) and the jobs compiling for them.

    backend: a canonical backend name or "auto"; auto_order: the backends "auto" tries, in
    order, when one refuses a spec (UnsupportedSpec) and fallback is on."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], backend: str,
                 auto_order: Sequence[str], fallback: bool, timeout_s: float, max_workers: int = 2) -> None:
        self._args = (tokenizer, vocab_size, tuple(eos_token_ids))
        self.backend = backend
        self.order = list(auto_order) if backend == "auto" else [backend]
        if backend == "auto" and not fallback:
            self.order = self.order[:1]
        self.timeout_s = timeout_s
        self._backends: dict[str, GrammarBackend | Exception] = {}
        self._jobs: OrderedDict[tuple, CompileJob] = OrderedDict()
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None

    def job(self, spec: CompileSpec) -> CompileJob:
        """The (cached, or newly submitted) job compiling `spec`. Never blocks."""
        key = (self.backend, spec)
        with self._lock:
            job = self._jobs.get(key)
            if job is not None:
                self._jobs.move_to_end(key)
                return job
            job = CompileJob(spec, self.timeout_s)
            self._jobs[key] = job
            while len(self._jobs) > CACHE_SIZE:
                self._jobs.popitem(last=False)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="pagedllm-grammar")
            pool = self._pool
        pool.submit(self._run, job)
        return job

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._jobs.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def get_backend(self, name: str) -> GrammarBackend:
        """The backend called `name`, built once (its vocabulary set-up); a backend that
        failed to build keeps failing with the same error."""
        with self._backend_lock:
            if name not in self._backends:
                try:
                    self._backends[name] = load_backend(name, *self._args)
                except Exception as exc:  # noqa: BLE001 - reported per request, engine stays up
                    self._backends[name] = exc if isinstance(exc, UnsupportedSpec) else \
                        UnsupportedSpec(f"the {name} backend could not be set up: {exc}")
                    logger.warning("structured outputs: %s", self._backends[name])
            backend = self._backends[name]
        if isinstance(backend, Exception):
            raise backend
        return backend

    def _run(self, job: CompileJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(self._compile(job))
        except BaseException as exc:  # noqa: BLE001 - every failure belongs to the request
            if not isinstance(exc, ValueError):
                exc = ValueError(f"{PREFIX}the grammar backend failed on this {job.spec.description}: "
                                 f"{type(exc).__name__}: {exc}")
            job.future.set_exception(exc)

    def _compile(self, job: CompileJob) -> CompiledGrammar:
        spec = job.spec
        refusals: list[str] = []
        refused = False  # by a backend that could have compiled (an unavailable one was logged once)
        for name in self.order:
            try:
                backend = self.get_backend(name)
            except UnsupportedSpec as exc:
                refusals.append(str(exc))
                continue
            try:
                job.mark_started()
                grammar = backend.compile(spec)
            except UnsupportedSpec as exc:
                refusals.append(str(exc))
                refused = True
                continue
            except ValueError as exc:
                raise ValueError(f"{PREFIX}invalid {spec.description}: {exc}") from None
            if refused:
                logger.info("structured outputs: %s; compiled the %s with the %s backend instead",
                            "; ".join(refusals), spec.description, name)
            return grammar
        tried = "" if self.backend != "auto" else f" (tried {', '.join(self.order)})"
        raise ValueError(f"{PREFIX}this {spec.description} cannot be compiled{tried}: {'; '.join(refusals)}")
