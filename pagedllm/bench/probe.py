"""How fast the machine is right now, measured the same way before every engine's run.

The development machines are shared VMs whose speed drifted by up to 2x within minutes
(measured: the same 30-layer bf16 GEMM pass took 144 ms, then 292 ms). `bench compare`
runs its engines one after the other, so a ratio between two engines can be the
machine's drift as much as the engines'. This probe (a fixed float32 matmul and a
memory read, about a second) runs before each engine's offline and serve phases; the
table prints it beside the figures, so a reader can see when two engines ran on a
machine in different moods.
"""

from __future__ import annotations

import time
from typing import Any


def machine_speed(seconds: float = 0.6) -> dict[str, Any]:
    """{"gflops": best float32 matmul rate, "read_gbs": best read bandwidth, "threads"}."""
    import torch

    a, b = torch.randn(384, 384), torch.randn(384, 384)
    flops = 2 * 384 ** 3
    best = 0.0
    deadline = time.perf_counter() + seconds / 2
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(8):
            torch.mm(a, b)
        best = max(best, 8 * flops / (time.perf_counter() - start))
    big = torch.ones(64 << 20 >> 2)  # 64 MiB: past every cache level of these machines
    read = 0.0
    deadline = time.perf_counter() + seconds / 2
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        big.sum()
        read = max(read, big.numel() * 4 / (time.perf_counter() - start))
    return {"gflops": round(best / 1e9, 1), "read_gbs": round(read / 1e9, 1), "threads": torch.get_num_threads()}
