"""Which cores a CPU engine computes on (`PAGEDLLM_CPU_OMP_THREADS_BIND`, vLLM's
`VLLM_CPU_OMP_THREADS_BIND`).

torch, oneDNN and the native kernels share one OpenMP pool, so one thread count and one
CPU mask steer them all. Values: `auto` (default: torch's thread count — OMP_NUM_THREADS,
else one per core — capped at the CPUs this process may run on), `nobind` (leave threads and affinity as
the environment set them), or a CPU list such as `0-3` or `0,2,4-7`: the process is
pinned there with one thread per listed CPU. Two engines sharing cores slow each other
far more than half (OpenMP threads spin while they wait for each other): give each its
own list.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("pagedllm")


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]; a ValueError names what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU number or range like 0-3")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"CPU list {text!r}: range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity; every CPU where that is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def apply(setting: str | None, local_rank: int = 0, local_ranks: int = 1) -> str:
    """Set torch's thread count (and the affinity, for a list); returns what was done.

    With several rank processes on this machine (`local_ranks`), `auto` gives each its
    own share of the available CPUs (two OpenMP processes on the same cores slow each
    other ten times over), and a `|`-separated value gives each rank its own list (vLLM's
    form: `0-3|4-7`)."""
    setting = (setting or "auto").strip()
    if setting == "nobind":
        return f"{torch.get_num_threads()} threads as the environment set them (nobind)"
    if local_ranks > 1:
        if "|" in setting:
            parts = setting.split("|")
            if len(parts) != local_ranks:
                raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND={setting!r} gives {len(parts)} CPU lists for "
                                 f"{local_ranks} ranks on this machine; give one list per rank")
            setting = parts[local_rank].strip()
        elif setting == "auto":
            allowed = allowed_cpus()
            if len(allowed) < local_ranks:
                torch.set_num_threads(1)
                return (f"{local_ranks} ranks share {len(allowed)} CPUs: 1 thread each, unpinned (auto; expect "
                        "them to slow each other)")
            share = len(allowed) // local_ranks
            setting = ",".join(map(str, allowed[local_rank * share:(local_rank + 1) * share]))
    if setting == "auto":
        allowed = allowed_cpus()
        threads = torch.get_num_threads()
        if threads > len(allowed):  # torch counted cores this process may not run on
            torch.set_num_threads(len(allowed))
            return f"{len(allowed)} threads, one per CPU available ({_ranges(allowed)}; torch counted {threads})"
        return f"{threads} threads on CPUs {_ranges(allowed)} (auto)"
    if "|" in setting:
        raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND={setting!r}: one list per rank ('|') needs as many "
                         "ranks; this engine runs one process, so give a single list such as 0-3")
    cpus = parse_cpu_list(setting)
    allowed = allowed_cpus()
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND={setting!r}: CPUs {_ranges(outside)} are not available "
                         f"to this process (available: {_ranges(allowed)})")
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    return f"{len(cpus)} threads pinned to CPUs {_ranges(cpus)}"


def _ranges(cpus: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
