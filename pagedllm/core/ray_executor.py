"""The Ray executor: ranks 1..N-1 are Ray actors, placed over a Ray cluster's machines.

Ray only places and supervises the rank processes; the ranks meet and talk over
torch.distributed exactly as the mp backend's do (same `serve_rank` loop, same step
messages), with the driver (rank 0) in the engine's process. Connects to the cluster
named by RAY_ADDRESS (`ray start --head` on one machine, `ray start --address HEAD:6379`
on the others), else starts a local one. The ranks go into one placement group of one
bundle per rank (a GPU each on CUDA, a CPU each otherwise), packed onto as few machines
as hold them.
"""

from __future__ import annotations

import logging
from typing import Any

from pagedllm.core import envs
from pagedllm.core.config import EngineConfig
from pagedllm.core.executor import (
    JOIN_TIMEOUT_S,
    DistributedExecutor,
    WorkerFactory,
    distributed_backend,
    free_port,
    layout_of,
    serve_rank,
    worker_factory,
)
from pagedllm.core.parallel import ParallelLayout, destroy_parallel_state, init_parallel_state

logger = logging.getLogger("pagedllm")


class _Rank:
    """The body of one rank actor (wrapped by ray.remote when the executor starts)."""

    def run(self, rank: int, layout: ParallelLayout, init_method: str, backend: str, config: EngineConfig) -> int:
        from pagedllm.core.logs import setup_logging

        setup_logging()
        try:
            state = init_parallel_state(layout, rank, init_method, backend, JOIN_TIMEOUT_S)
            serve_rank(state, worker_factory(config))
        finally:
            destroy_parallel_state()
        return rank


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'ray>=2.40' (or use mp on "
                         "one machine)") from None
    return ray


class RayExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, make_driver: WorkerFactory) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, log_to_driver=True)
        layout = layout_of(config)
        backend = distributed_backend(config)
        on_gpu = backend == "nccl"
        bundle = {"GPU": 1} if on_gpu else {"CPU": 1}
        self.group = placement_group([dict(bundle) for _ in range(layout.world_size - 1)], strategy="PACK")
        ray.get(self.group.ready(), timeout=JOIN_TIMEOUT_S)
        host = envs.get("PAGEDLLM_HOST_IP") or ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{config.parallel.master_port or free_port()}"
        actor_cls = ray.remote(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0)(_Rank)
        self.actors, self.runs = [], []
        for i, rank in enumerate(range(1, layout.world_size)):
            actor = actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=i)).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(rank, layout, init_method, backend, config))
        logger.info("started %d rank actors on Ray (%s, meeting at %s)", len(self.actors), backend, init_method)
        self._join(layout, init_method, backend, make_driver)

    def _failure(self, wait_s: float = 0.0) -> str | None:
        ray = _ray()
        done, _ = ray.wait(self.runs, num_returns=1, timeout=wait_s)
        if not done:
            return None
        rank = self.runs.index(done[0]) + 1
        try:
            ray.get(done[0])
            return f"rank {rank} (Ray actor) stopped"
        except Exception as exc:  # noqa: BLE001 - its error is the message
            return f"rank {rank} (Ray actor) failed: {exc}"

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = _ray()
        self._stop_ranks_gently()
        ray.wait(self.runs, num_returns=len(self.runs), timeout=10)
        for actor in self.actors:
            ray.kill(actor)
        try:
            ray.util.remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 - the cluster may be gone already
            pass
        destroy_parallel_state()
