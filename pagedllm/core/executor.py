"""Executors: between the engine and its ranks.

The engine talks to one `Executor`: it asks for the driver's `Worker` (rank 0, in the
engine's process: it samples and proposes) and hands each step's `SchedulerOutput` to
`execute`. The executor encodes it once (core/step.py), gives the message to every
other rank, and returns the driver's result.

- `uni`: one rank, in this process (what every one-rank engine uses);
- `mp`: one spawned process per rank on this machine (and, with `--nnodes`, the ranks
  of other machines started there with `pagedllm serve --headless`), torch.distributed
  over TCP (gloo on the CPU, NCCL on CUDA);
- `ray`: the ranks are Ray actors placed over a Ray cluster's machines.

A rank that fails or dies ends the engine: `EngineDeadError` names the rank and its
error, the engine loop stops, the server answers 503 on /health and exits non-zero.
No rank outlives the engine's process (a parent-death signal kills it).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import queue
import signal
import socket
import sys
import time
import traceback
from abc import ABC, abstractmethod
from typing import Any, Callable

from pagedllm.core import envs, heap
from pagedllm.core.config import EngineConfig
from pagedllm.core.parallel import ParallelLayout, ParallelState, destroy_parallel_state, init_parallel_state
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.core.worker import StepResult, Worker

logger = logging.getLogger("pagedllm")

# how long ranks wait for each other to join (a rank that never starts fails the engine after it)
JOIN_TIMEOUT_S = 120.0


class EngineDeadError(RuntimeError):
    """A rank failed or died: the engine cannot go on."""


# a rank's state -> its Worker (the driver's, or another rank's built from the config)
WorkerFactory = Callable[[ParallelState], Worker]


class Executor(ABC):
    driver: Worker

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.driver.execute(out, self._send)

    _send: Callable[[Any], None] | None = None

    def check_health(self) -> None:
        """Raise EngineDeadError when a rank is gone (called between steps)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""


class UniprocExecutor(Executor):
    def __init__(self, make_worker: WorkerFactory) -> None:
        self.driver = make_worker(ParallelState.single())

    def shutdown(self) -> None:
        pass


def layout_of(config: EngineConfig) -> ParallelLayout:
    p = config.parallel
    return ParallelLayout(p.tensor_parallel_size, p.pipeline_parallel_size, p.enable_expert_parallel)


def distributed_backend(config: EngineConfig) -> str:
    return "nccl" if config.device.resolved_device() == "cuda" else "gloo"


def host_ip(config: EngineConfig) -> str:
    return envs.get("PAGEDLLM_HOST_IP") or config.parallel.master_addr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def meeting_port(config: EngineConfig) -> int:
    """--master-port, else VLLM_PORT / PAGEDLLM_PORT, else a free port."""
    if config.parallel.master_port is not None:  # data-parallel replicas meet on the ports after it
        return config.parallel.master_port + config.parallel.data_parallel_rank
    given = envs.get("PAGEDLLM_PORT")
    if given:
        try:
            return int(given)
        except ValueError:
            raise ValueError(f"{envs.source('PAGEDLLM_PORT')}={given!r} is not a port number") from None
    return free_port()


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that spawned it ends."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve_rank(state: ParallelState, make_worker: WorkerFactory) -> None:
    """A rank other than the driver: build its worker, then run every step the driver
    broadcasts until it broadcasts None (shutdown)."""
    worker = make_worker(state)
    while True:
        msg = state.world.broadcast_object(None, src=0)
        if msg is None:
            return
        worker.run(msg)


def rank_main(rank: int, layout: ParallelLayout, init_method: str, backend: str, config: EngineConfig,
              errors: Any) -> None:
    """Entry point of a spawned rank process (mp backend)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group: the driver stops us
    from pagedllm.core.logs import setup_logging

    setup_logging()
    try:
        state = init_parallel_state(layout, rank, init_method, backend, JOIN_TIMEOUT_S)
        serve_rank(state, worker_factory(config))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, then this rank exits
        if errors is not None:
            errors.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        logger.error("rank %d failed: %s", rank, exc)
        sys.exit(1)
    finally:
        destroy_parallel_state()


def worker_factory(config: EngineConfig) -> WorkerFactory:
    """How any rank builds its Worker from the config alone (a headless node has nothing
    else): the model opened and its limits derived as the engine derives them."""
    def make(state: ParallelState) -> Worker:
        from pagedllm.core.engine import engine_limits
        from pagedllm.core.loader import open_configured_model
        from pagedllm.core.plugins import get_registry

        with heap.built_once():  # a rank's heap, as the engine's (core/heap.py)
            registry = get_registry()
            source = open_configured_model(config, registry)
            max_model_len, budget, spec_config = engine_limits(config, source, registry)
            return Worker(config, source, registry, max_model_len, budget, spec_config, state)
    return make


class DistributedExecutor(Executor):
    """What the mp and Ray executors share: rank 0 here, the other ranks elsewhere,
    every step's message broadcast to them, and a gone rank turned into EngineDeadError.
    Subclasses start the ranks, then call `_join`, and say what ended a rank (`_failure`)."""

    state: ParallelState
    _dead: str | None = None
    _closed = False

    def _join(self, layout: ParallelLayout, init_method: str, backend: str, make_driver: WorkerFactory) -> None:
        try:
            self.state = init_parallel_state(layout, 0, init_method, backend, JOIN_TIMEOUT_S)
            self.driver = make_driver(self.state)
        except BaseException as exc:
            failure = self._failure(wait_s=2.0)
            self.shutdown()
            if failure is not None and not isinstance(exc, (ValueError, NotImplementedError)):
                raise EngineDeadError(failure) from exc
            raise
        self._send = self._broadcast

    def _broadcast(self, msg: Any) -> None:
        try:
            self.state.world.broadcast_object(msg, src=0)
        except Exception as exc:
            raise self._dead_error(exc) from exc

    def execute(self, out: SchedulerOutput) -> StepResult:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            return super().execute(out)
        except EngineDeadError:
            raise
        except RuntimeError as exc:  # a collective failed: a peer is gone
            raise self._dead_error(exc) from exc

    def _dead_error(self, exc: BaseException) -> EngineDeadError:
        self._dead = self._failure(wait_s=2.0) or f"a rank stopped answering ({exc})"
        return EngineDeadError(self._dead)

    @abstractmethod
    def _failure(self, wait_s: float = 0.0) -> str | None:
        """What ended a rank (its error or exit), waiting up to `wait_s`; None while all run."""

    def check_health(self) -> None:
        if self._dead is None:
            self._dead = self._failure()
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _stop_ranks_gently(self) -> None:
        """Tell the ranks to return (a None message), unless they are past hearing it."""
        if self._dead is None and self._send is not None:
            try:
                self.state.world.broadcast_object(None, src=0)
            except Exception:  # noqa: BLE001 - the ranks are being stopped anyway
                pass


class MultiprocExecutor(DistributedExecutor):
    """One process per rank; this process is rank 0 (the driver)."""

    def __init__(self, config: EngineConfig, make_driver: WorkerFactory) -> None:
        import torch.multiprocessing as mp

        layout = layout_of(config)
        p = config.parallel
        first = p.node_rank * p.ranks_per_node
        init_method = f"tcp://{host_ip(config)}:{meeting_port(config)}"
        backend = distributed_backend(config)
        ctx = mp.get_context("spawn")
        self.errors = ctx.Queue()
        self.procs = {}
        for rank in range(max(first, 1), first + p.ranks_per_node):
            proc = ctx.Process(target=rank_main, name=f"pagedllm-rank-{rank}", daemon=True,
                               args=(rank, layout, init_method, backend, config, self.errors))
            proc.start()
            self.procs[rank] = proc
        logger.info("started %d rank processes (pp %d x tp %d, %s, meeting at %s)", len(self.procs),
                    layout.pipeline_parallel_size, layout.tensor_parallel_size, backend, init_method)
        self._join(layout, init_method, backend, make_driver)
        atexit.register(self.shutdown)  # ranks told to stop before the interpreter kills them

    def _failure(self, wait_s: float = 0.0) -> str | None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                rank, message, _ = self.errors.get(timeout=0.05) if wait_s else self.errors.get_nowait()
                return f"rank {rank} failed: {message}"
            except queue.Empty:
                pass
            for rank, proc in self.procs.items():
                if not proc.is_alive():
                    return f"rank {rank} died (exit code {proc.exitcode})"
            if time.monotonic() >= deadline:
                return None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_ranks_gently()
        for proc in self.procs.values():
            proc.join(timeout=5)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        destroy_parallel_state()


def run_headless(config: EngineConfig) -> int:
    """`pagedllm serve --headless --node-rank R`: run this node's ranks until the driver
    (node 0) shuts them down; the exit status is 0 when every rank ended cleanly."""
    import torch.multiprocessing as mp

    p = config.parallel
    layout = layout_of(config)
    init_method = f"tcp://{p.master_addr}:{meeting_port(config)}"
    ctx = mp.get_context("spawn")
    first = p.node_rank * p.ranks_per_node
    procs = [ctx.Process(target=rank_main, name=f"pagedllm-rank-{r}",
                         args=(r, layout, init_method, distributed_backend(config), config, None))
             for r in range(first, first + p.ranks_per_node)]
    for proc in procs:
        proc.start()
    logger.info("headless node %d: ranks %d..%d, meeting at %s", p.node_rank, first, first + len(procs) - 1,
                init_method)
    try:
        for proc in procs:
            proc.join()
    except KeyboardInterrupt:
        for proc in procs:
            proc.kill()
        return 130
    return max((proc.exitcode or 0) for proc in procs)


def make_executor(config: EngineConfig, make_driver: WorkerFactory) -> Executor:
    backend = config.parallel.executor_backend
    if backend == "uni":
        return UniprocExecutor(make_driver)
    if backend == "mp":
        return MultiprocExecutor(config, make_driver)
    from pagedllm.core.ray_executor import RayExecutor

    return RayExecutor(config, make_driver)

