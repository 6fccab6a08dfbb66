"""Run a function on N gloo ranks (one spawned process each) and collect what each returns.

`fn(state, *args)` runs in every rank with its `ParallelState` (core/parallel.py); it
must be a module-level function (spawned processes import it). Results come back in
rank order; an exception in any rank fails the call with that rank's traceback. A result
travels as `torch.save` bytes: a tensor put on a torch.multiprocessing queue as is goes
as a shared-memory handle, which the parent cannot open once the rank has exited.
"""

from __future__ import annotations

import io
import os
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from pagedllm.core.parallel import ParallelLayout, destroy_parallel_state, init_parallel_state


def _rank_main(rank: int, layout: ParallelLayout, init_file: str, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        state = init_parallel_state(layout, rank, f"file://{init_file}", "gloo", timeout_s=120)
        buffer = io.BytesIO()
        torch.save(fn(state, *args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_parallel_state()


def run_ranks(fn: Callable, layout: ParallelLayout, *args: Any, timeout_s: float = 300) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank_main, args=(r, layout, init_file, fn, args, results))
                 for r in range(layout.world_size)]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        errors = []
        try:
            for _ in procs:
                rank, status, value = results.get(timeout=timeout_s)
                if status == "error":
                    errors.append(f"rank {rank} failed:\n{value}")
                else:
                    got[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        if errors:
            raise AssertionError("\n".join(errors))
    return [got[r] for r in range(layout.world_size)]
