"""How a CPU engine's process reuses freed memory (`PAGEDLLM_CPU_MALLOC_REUSE_MB`).

Why: glibc's malloc serves an allocation above its mmap threshold (at most 32 MiB, however
it adapts) with a fresh memory map and unmaps it on free, so the next one is faulted in
page by page again. A model's large steps allocate such tensors every time (Qwen2.5-1.5B's
gate/up output for 1,024 prompt tokens is 73 MB): an offline 32 x 32-token prefill of that
model took 250,000-500,000 minor page faults and 2.1-2.7 s on a 2-vCPU Xeon VM, where a
first touch is slow (the host backs guest memory lazily), and 0 faults and 2.0-2.3 s with
the threshold raised. vLLM's CPU backend recommends preloading tcmalloc for the same kind
of reuse. So the engine raises glibc's mmap and trim thresholds to this many MiB: freed
blocks up to that size stay in the heap for the next step. After loading, the heap's free
pages go back to the OS (`release_free`), so what loading freed does not stay resident.

Only glibc has these knobs (`mallopt`); elsewhere nothing changes. 0 keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("pagedllm")

DEFAULT_REUSE_MB = 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def apply(setting: str | None) -> str:
    """Raise glibc's thresholds to `setting` MiB (default DEFAULT_REUSE_MB; "0": leave them);
    returns what was done, for the log."""
    mib = DEFAULT_REUSE_MB if setting is None or not setting.strip() else int(setting)
    if mib == 0:
        return "glibc's defaults (PAGEDLLM_CPU_MALLOC_REUSE_MB=0)"
    libc = _glibc()
    if libc is None:
        return "this C library's defaults (no glibc mallopt here)"
    nbytes = min(mib << 20, (1 << 31) - 1)  # mallopt takes an int
    if not (libc.mallopt(_M_MMAP_THRESHOLD, nbytes) and libc.mallopt(_M_TRIM_THRESHOLD, nbytes)):
        return "glibc's defaults (mallopt refused the thresholds)"
    return f"freed blocks up to {nbytes >> 20} MiB are reused, not unmapped (PAGEDLLM_CPU_MALLOC_REUSE_MB)"


def release_free() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim): after loading,
    whose temporaries the raised thresholds would otherwise keep resident."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
