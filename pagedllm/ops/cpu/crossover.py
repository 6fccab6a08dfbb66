"""Where one matmul kernel overtakes another, measured on this machine.

Which kernel is fastest for a batch of `rows` depends on the CPU (AMX, AVX512-BF16 or
AVX2 alone), the thread count and the weight's shape: on a Sapphire Rapids with AMX,
oneDNN's bf16 GEMM beat the native Q4_1 kernel from 2 rows up, while on a Zen 3 the
Q4_1 kernel won up to 8-16 rows against the float32 GEMM. So callers that hold a
weight in two layouts ask `rows_from` once per layer shape, at load, instead of using a
fixed threshold. Results are cached in memory and on disk
(`$PAGEDLLM_CACHE_DIR/crossovers.json`, keyed by CPU model, flags and threads), so later
start-ups skip the timing and pick the same paths.

Each kernel is timed as a model step meets it: a step streams one layer's weight after
another from memory, so a call's weight is not in cache, but the memory system is already
streaming and the threads are awake. Timing one weight after evicting the caches (writing
twice the last-level cache) did not reproduce that: on a 2-core Zen 5, SmolLM2's 960 x 576
Q4_1 layer took ~130 us per 1-row call after an eviction against ~15-20 us streamed (and
25-30 us after merely sleeping 2 ms), which buried the kernels' differences in noise and
chose torch's int4 kernel where VNNI was 1.5x faster in the step. So each side is a
`Contender` that can build copies of itself on its own copies of the weight, and a timing
walks a ring of copies holding the last-level cache together, a segment per timed pass, in
turn with the other side's ring.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Union

import torch

from pagedllm.ops.cpu import features, native

logger = logging.getLogger("pagedllm")

# Row counts tried, in order; the answer is one of them (or NEVER).
CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
# `rows_from` answer when the small-batch kernel won at every candidate.
NEVER = 1 << 30

_memo: dict[str, int] = {}

Kernel = Callable[[torch.Tensor], torch.Tensor]

# Alternating passes over both rings per candidate row count (at least; more within the
# time budget, up to twice as many).
PASSES = 4

# After the first alternating round, a side this many times faster than the other has won
# that row count: the further rounds are for close calls. On a 2-core Zen 4, SmolLM2's
# contests mostly compared kernels 1.4-2.5x apart; timing every row count in full took
# ~3.4 s of a first start-up, deciding clear gaps after one round ~2.7 s.
DECISIVE = 1.3

# A ring never holds more copies than this (a tiny test model's weights stay cached then,
# which costs nothing that matters).
MAX_COPIES = 256


@dataclass(frozen=True)
class Contender:
    """One side of a crossover. `kernel` is the one that will serve; `copy()` builds another
    like it on its own copy of the weight (None for a kernel that reads no weight, e.g. in
    tests); `nbytes` is what one call reads of its weight, which sets how many copies make
    a ring of the last-level cache."""

    kernel: Kernel
    copy: Callable[[], Kernel] | None = None
    nbytes: int = 0
    # the copies built for a first contest, reused by the next ones this contender enters (a
    # layer's winning kernel meets two or three rivals in turn); freed with the contender
    copies: list[Kernel] = field(default_factory=list, compare=False, repr=False)


Side = Union[Contender, Kernel]


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


# A ring never holds more bytes than this. A VM may report its host's whole last-level cache:
# a 2-vCPU Xeon with AMX reported 480 MiB, while its reads slowed to memory speed past
# 64-128 MiB (53 GiB/s to 64 MiB, 31 GiB/s from 256 MiB). Rings of twice 480 MiB took ~13 s
# of a first start-up there (building and first-touching the copies), 256 MiB ~6 s; every
# SmolLM2 contest gave the same answer at 960, 256 and 128 MiB.
MAX_RING_BYTES = 128 << 20


def ring_bytes() -> int:
    """Bytes of weight in one side's timing ring: the last-level cache, at least 16 MiB where
    sysfs reports less (or nothing), at most MAX_RING_BYTES. The two sides' rings are walked
    in turn, so between two calls of one copy the walks read both rings: twice the cache."""
    return max(16 << 20, min(MAX_RING_BYTES, last_level_cache_bytes()))


def _ring(side: Side) -> list[Kernel]:
    if not isinstance(side, Contender):
        return [side]
    copies = 1 if side.copy is None or side.nbytes <= 0 else min(MAX_COPIES, -(-ring_bytes() // side.nbytes))
    side.copies.extend(side.copy() for _ in range(copies - 1 - len(side.copies)))
    return [side.kernel] + side.copies


# A timed pass calls the next 1/SEGMENTS of a side's ring, going on from where that side's
# last pass stopped. Every copy a pass calls was last called a whole walk of both rings ago
# (twice the last-level cache), so a segment meets weights from memory as a whole ring does,
# at a fraction of the cost: full-ring passes (a warm-up and three rounds per row count)
# were ~4.6 s of a first start-up on a 2-vCPU Xeon with AMX.
SEGMENTS = 4


class _Walk:
    """One side's kernels called in ring order, a segment per pass (1/`segments` of the ring:
    both sides of a contest take the same fraction, so each side's revisit of a copy still
    lies a walk of both rings after the last)."""

    def __init__(self, ring: list[Kernel]) -> None:
        self.ring, self.at = ring, 0
        self.segments = SEGMENTS

    @property
    def size(self) -> int:
        return -(-len(self.ring) // self.segments)

    def timed_pass(self, x: torch.Tensor) -> float:
        """Seconds per call over the next segment."""
        size = self.size
        start = time.perf_counter()
        for i in range(self.at, self.at + size):
            self.ring[i % len(self.ring)](x)
        self.at = (self.at + size) % len(self.ring)
        return (time.perf_counter() - start) / size


def _time_both(small: _Walk, large: _Walk, x: torch.Tensor, budget_s: float) -> tuple[float, float]:
    """Seconds per call of each side: the best of alternating passes over the two rings
    (after a warm-up pass of each; one round when its gap is DECISIVE), so that both see
    the same moments of a machine whose speed drifts by +-20% within minutes. Timing one
    side's passes and then the other's let a drift decide: SmolLM2's 960 x 576 layer once
    got the VNNI kernel up to 64 rows where the bf16 GEMM was 1.2x faster from 32 (and made
    a step 1.08x slower)."""
    small.timed_pass(x), large.timed_pass(x)
    best_small = best_large = float("inf")
    spent, rounds = 0.0, 0
    while rounds < PASSES or (spent < budget_s and rounds < 2 * PASSES):
        small_s, large_s = small.timed_pass(x), large.timed_pass(x)
        best_small, best_large = min(best_small, small_s), min(best_large, large_s)
        spent += small_s * small.size + large_s * large.size
        rounds += 1
        if rounds == 1 and max(best_small, best_large) >= DECISIVE * min(best_small, best_large):
            break
    return best_small, best_large


def measure(small: Side, large: Side, k: int, candidates: tuple[int, ...] = CANDIDATES,
            budget_s: float = 0.01) -> int:
    """The smallest candidate row count from which `large` is faster than `small` on two
    candidates in a row (or at the last one), NEVER if it never is; both kernels take a
    float32 [rows, k] input. A plain kernel (no Contender) is timed on its one weight."""
    gen = torch.Generator().manual_seed(0)
    small_walk, large_walk = _Walk(_ring(small)), _Walk(_ring(large))
    won = []
    for rows in candidates:
        x = torch.randn(rows, k, generator=gen)
        # past 64 rows a call's arithmetic outweighs its weight's reads: shorter segments (as
        # many calls as 64 rows made), which kept the AVX2 VNNI form's 256-row contests on a
        # 2-vCPU Xeon at ~0.2 s a layer shape instead of ~0.8
        small_walk.segments = large_walk.segments = SEGMENTS * max(1, rows // 64)
        small_s, large_s = _time_both(small_walk, large_walk, x, budget_s)
        won.append(large_s < small_s)
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
    # how a figure was measured (alternating passes over rings of this many bytes): a
    # change re-measures
    return f"{cpu.model}|{flags}|threads={torch.get_num_threads()}|walk={ring_bytes() >> 20}M"


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


def rows_from(what: str, small: Side, large: Side, k: int, candidates: tuple[int, ...] = CANDIDATES) -> int:
    """From how many rows `large` should serve a layer (smaller batches take `small`).

    `what` names the kernel pair and weight shape (e.g. "q4_1|onednn-bf16|960x576"): the
    cache key, with this machine's CPU and thread count added. A caller that only asks
    whether `large` wins from the first row passes `candidates=(1, 2)`: timing every row
    count up to 64 cost a cold start-up ~1 s per layer shape for an answer it ignored.
    """
    key = _key(what, candidates)
    cached = _recall(key)
    if cached is not None:
        return cached
    rows = measure(small, large, k, candidates)
    _memo[key] = rows
    _store(key, rows)
    logger.info("kernel crossover %s: the second kernel from %s rows", what,
                "never" if rows == NEVER else rows)
    return rows


def known(what: str, candidates: tuple[int, ...] = CANDIDATES) -> int | None:
    """What `rows_from` would answer without measuring: the answer measured on this machine
    before, or None. Lets a caller skip building a contender that already lost."""
    return _recall(_key(what, candidates))


def _key(what: str, candidates: tuple[int, ...]) -> str:
    key = f"{_machine_key()}|{what}"
    if candidates != CANDIDATES:
        key += "|rows=" + ",".join(map(str, candidates))
    return key


def _recall(key: str) -> int | None:
    if key in _memo:
        return _memo[key]
    cached = _load().get(key)
    if cached is not None:
        _memo[key] = cached
    return cached


def forget() -> None:
    """Drop the in-memory answers (tests; the disk cache stays)."""
    _memo.clear()
