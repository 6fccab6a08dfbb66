"""Where one matmul kernel overtakes another, measured on this machine.

Which kernel is fastest for a batch of `rows` depends on the CPU (AMX, AVX512-BF16 or
AVX2 alone), the thread count and the weight's shape: on a Sapphire Rapids with AMX,
oneDNN's bf16 GEMM beat the native Q4_1 kernel from 2 rows up, while on a Zen 3 the
Q4_1 kernel won up to 8-16 rows against the float32 GEMM. So callers that hold a
weight in two layouts ask `rows_from` once per layer shape, at load, instead of using a
fixed threshold. Results are cached in memory and on disk
(`$PAGEDLLM_CACHE_DIR/crossovers.json`, keyed by CPU model, flags and threads), so later
start-ups skip the timing and pick the same paths.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from pagedllm.ops.cpu import features, native

logger = logging.getLogger("pagedllm")

# Row counts tried, in order; the answer is one of them (or NEVER).
CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
# `rows_from` answer when the small-batch kernel won at every candidate.
NEVER = 1 << 30

_memo: dict[str, int] = {}

Kernel = Callable[[torch.Tensor], torch.Tensor]


# Bytes written between timed calls so a layer's weight is measured as a step meets it,
# from memory (a model's layers stream through the caches, each once per step): timed
# hot, a bf16 weight 4x the bytes of the 4-bit one measured faster at one row on a 2-core
# Sapphire Rapids and ran single-stream decode 20% slower. At least this much, and twice
# the last-level cache where that is larger: on a Zen 4 with 32 MiB of L3, 16 MiB left
# SmolLM2's bf16 weights in L3, the bf16 GEMM won at one row, and single-stream decode
# ran at 0.64x.
EVICT_BYTES = 16 << 20


@functools.lru_cache(maxsize=1)
def last_level_cache_bytes() -> int:
    """The largest cache Linux reports for CPU 0 (0 where sysfs says nothing)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def evict_bytes() -> int:
    return max(EVICT_BYTES, 2 * last_level_cache_bytes())


def _best_time(fn: Kernel, x: torch.Tensor, budget_s: float, evict: torch.Tensor) -> float:
    """The fastest of a few calls (after one warm-up), within about `budget_s`, each after
    the caches were filled with other data (writing `evict`)."""
    fn(x)
    best = float("inf")
    spent, calls = 0.0, 0
    while calls < 3 or (spent < budget_s and calls < 20):
        evict.fill_(1)
        start = time.perf_counter()
        fn(x)
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def measure(small: Kernel, large: Kernel, k: int, candidates: tuple[int, ...] = CANDIDATES,
            budget_s: float = 0.01) -> int:
    """The smallest candidate row count from which `large` is faster than `small` on two
    candidates in a row (or at the last one), NEVER if it never is; both kernels take a
    float32 [rows, k] input."""
    gen = torch.Generator().manual_seed(0)
    evict = torch.empty(evict_bytes(), dtype=torch.uint8)  # freed once measured
    won = []
    for rows in candidates:
        x = torch.randn(rows, k, generator=gen)
        won.append(_best_time(large, x, budget_s, evict) < _best_time(small, x, budget_s, evict))
        if len(won) >= 2 and won[-1] and won[-2]:
            return candidates[len(won) - 2]
    if won and won[-1]:
        return candidates[len(won) - 1]
    return NEVER


def _cache_file() -> Path:
    return native.cache_dir() / "crossovers.json"


def _machine_key() -> str:
    cpu = features.detect()
    flags = hashlib.sha256(" ".join(sorted(cpu.flags)).encode()).hexdigest()[:12]
    # the eviction size is part of how a figure was measured: a change re-measures
    return f"{cpu.model}|{flags}|threads={torch.get_num_threads()}|evict={evict_bytes() >> 20}M"


def _load() -> dict[str, int]:
    try:
        data = json.loads(_cache_file().read_text())
        return {k: int(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def _store(key: str, rows: int) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load()
        data[key] = rows
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(tmp, path)  # concurrent writers: the last whole file wins
    except OSError as exc:
        logger.debug("crossover cache not written (%s)", exc)


def rows_from(what: str, small: Kernel, large: Kernel, k: int) -> int:
    """From how many rows `large` should serve a layer (smaller batches take `small`).

    `what` names the kernel pair and weight shape (e.g. "q4_1|onednn-bf16|960x576"): the
    cache key, with this machine's CPU and thread count added.
    """
    key = f"{_machine_key()}|{what}"
    if key in _memo:
        return _memo[key]
    cached = _load().get(key)
    if cached is not None:
        _memo[key] = cached
        return cached
    rows = measure(small, large, k)
    _memo[key] = rows
    _store(key, rows)
    logger.info("kernel crossover %s: the second kernel from %s rows", what,
                "never" if rows == NEVER else rows)
    return rows


def forget() -> None:
    """Drop the in-memory answers (tests; the disk cache stays)."""
    _memo.clear()
