"""Builds and loads the native CPU kernels (csrc/: one .c file per kernel family and the
header they share, pd_kernels.h) through ctypes, as one library.

Why ctypes and a C compiler at run time rather than a torch C++ extension: plain C
compiles in seconds (torch's headers take a minute), needs no build step at
install time, and the library is built for the CPU it runs on (-march=native). The
result is cached under `PAGEDLLM_CACHE_DIR` (default ~/.cache/pagedllm), keyed by every
source and header, the flags and the CPU's feature flags, so editing any of them rebuilds
and a shared home directory never hands one machine another's binary.

If no compiler is found or the build fails, `kernels()` returns None and the callers
keep their torch paths; `PAGEDLLM_CPU_KERNELS=0` turns the native path off on purpose.
Tensors passed in must be contiguous float32 / uint8 / int32 / int64 CPU tensors: the
wrappers below check what the C code assumes, and raise a ValueError naming the argument.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from pagedllm.core import cpu_threads, envs
from pagedllm.ops.cpu import features

logger = logging.getLogger("pagedllm")

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(p for p in CSRC.glob("*.c") if not p.name.startswith("."))  # linked into one library
HEADERS = sorted(p for p in CSRC.glob("*.h") if not p.name.startswith("."))
ABI_VERSION = 17  # what this module's signatures expect: pd_abi_version() (PD_ABI_VERSION) must match
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c11", "-fno-math-errno"]  # compiling each source
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
# what each PAGEDLLM_CPU_MAX_ISA level adds to FLAGS (features.ISA_LEVELS names the same limits)
ISA_FLAGS = {"native": [], "avx512_bf16": ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],
             "avx2_vnni": ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],
             "avx2": ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-mno-avxvnni"]}


def compile_flags() -> list[str]:
    """FLAGS for this process's PAGEDLLM_CPU_MAX_ISA."""
    return FLAGS + ISA_FLAGS[features.max_isa()]

# what the kernels that return an int return (PD_* in csrc/pd_kernels.h)
PD_OK, PD_EINVAL, PD_ENOMEM, PD_ERANGE = 0, -1, -2, -3

# ggml type ids the quantized linear kernel reads
SUPPORTED_QTYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
# ... and those the VNNI kernel reads as stored (Q4_K: K a multiple of 256)
VNNI_QTYPES = {**SUPPORTED_QTYPES, 12: "Q4_K"}
# (values per block, bytes per block) of each, and of the K-quants blocks.c converts at load (Q5_K, Q6_K)
_BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}

_i64, _f32, _i32, _p = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "pd_abi_version": (_i32, []),
    "pd_has_avx2": (_i32, []),
    "pd_repack": (_i32, [_i32, _p, _i64, _i64, _p, _p, _p]),
    "pd_linear_packed": (_i32, [_i32, _p, _i64, _i64, _p, _p, _p, _i64, _p, _i64]),
    "pd_linear_packed_gemm": (_i32, [_i32, _p, _i64, _i64, _p, _p, _p, _i64, _p, _i64]),
    "pd_linear_lut4": (_i32, [_p, _i64, _i64, _p, _p, _p, _i64, _i64, _p, _i64]),
    "pd_dequantize": (_i32, [_i32, _p, _i64, _i64, _p]),
    "pd_dequantize_k": (_i32, [_i32, _p, _i64, _p]),
    "pd_q4_k_as_q4_1": (_i32, [_p, _i64, _p]),
    "pd_as_q8_0": (_i32, [_p, _i64, _p]),
    "pd_sgemm_pack": (None, [_p, _i64, _i64, _p]),
    "pd_sgemm": (_i32, [_p, _i64, _i64, _i64, _p, _i64, _p, _p, _i64]),
    "pd_moe_f32": (_i32, [_p, _i64, _i64, _p, _p, _i64, _i64, _p, _p, _i64, _i32, _p]),
    "pd_rms_norm": (None, [_p, _p, _p, _p, _i64, _i64, _f32]),
    "pd_silu_mul": (None, [_p, _p, _i64, _i64]),
    "pd_rope_neox": (None, [_p, _i64, _i64, _i64, _i64, _p, _p]),
    "pd_write_kv": (None, [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64]),
    "pd_paged_attention": (_i32, [_p, _i64, _p, _p, _p, _i64, _p, _p, _p, _i64, _p, _i64, _i64, _i64, _i64,
                                  _f32, _i64, _f32]),
    "pd_gather_rows": (_i32, [_p, _i64, _i64, _p, _i64, _p]),
    "pd_gather_rows_bf16": (_i32, [_p, _i64, _i64, _p, _i64, _p]),
    "pd_argmax_rows": (None, [_p, _i64, _i64, _i64, _p]),
    "pd_write_kv_bf16": (None, [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64]),
    "pd_paged_attention_bf16": (_i32, [_p, _i64, _p, _p, _p, _i64, _p, _p, _p, _i64, _p, _i64, _i64, _i64, _i64,
                                       _f32, _i64, _f32]),
    "pd_has_bf16_kv": (_i32, []),
    "pd_attention_tiles": (_i32, [_i64, _i64]),
    "pd_has_amx": (_i32, []),
    "pd_amx_packed_size": (_i64, [_i64, _i64]),
    "pd_amx_pack": (None, [_p, _i64, _i64, _p]),
    "pd_amx_linear": (_i32, [_p, _i32, _i64, _i64, _i64, _p, _i64, _p, _p, _i32, _i64]),
    "pd_amx_linear_silu": (_i32, [_p, _i32, _i64, _i64, _i64, _p, _i64, _p, _p, _i64]),
    "pd_amx_qt_packed_size": (_i64, [_i32, _i64, _i64]),
    "pd_amx_qt_pack": (_i32, [_i32, _p, _i64, _i64, _p]),
    "pd_amx_qt_linear": (_i32, [_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i64]),
    "pd_amx_qt_linear_silu": (_i32, [_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i64]),
    "pd_has_bf16dot": (_i32, []),
    "pd_bf16dot_linear": (_i32, [_p, _i32, _i64, _i64, _i64, _p, _i64, _p, _p, _i32, _i64]),
    "pd_bf16dot_linear_silu": (_i32, [_p, _i32, _i64, _i64, _i64, _p, _i64, _p, _p, _i64]),
    "pd_has_vnni": (_i32, []),
    "pd_vnni_packed_size": (_i64, [_i32, _i64, _i64]),
    "pd_vnni_pack": (_i32, [_i32, _p, _i64, _i64, _p]),
    "pd_vnni_linear": (_i32, [_i32, _i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i64]),
    "pd_replay_kernel": (_i32, [ctypes.c_char_p, ctypes.c_char_p]),
    "pd_replay_call_size": (_i64, []),
    "pd_replay": (_i64, [_p, _i64, _p]),
}


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        data = path.read_bytes()
        key.update(f"{path.name}:{len(data)}:".encode())
        key.update(data)
    for part in (" ".join(compile_flags() + LINK_FLAGS).encode(), compiler.encode(), _cpu_fingerprint().encode()):
        key.update(part)
    return cache_dir() / "native" / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def cache_dir() -> Path:
    """Where pagedllm keeps what it builds and measures per machine: `PAGEDLLM_CACHE_DIR`,
    default ~/.cache/pagedllm (this library, crossover.py's measurements)."""
    return Path(envs.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm")


def _run_compiler(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")


def compile_units(sources: Sequence[Path], workers: int) -> list[list[Path]]:
    """How `_build` splits the sources among `workers` compiler processes: the largest first,
    each onto the unit with the fewest bytes so far (so the largest source starts a unit, and
    every source is alone where there are as many workers as sources).

    Why units rather than one process per file: each compiler process parses the same
    headers (immintrin.h alone is ~0.15 s) and starts up again, and on a 2-core machine only
    two run at once anyway. On a 2-core Zen 4, attention.c alone compiled in ~2.7 s and the
    ten other files together in ~3.4 s as one unit (one by one, all eleven took ~7.5 s).
    Why by bytes rather than the largest source alone: once vnni.c, amx.c and bf16dot.c had
    grown, the unit beside attention.c was the slower one (4.3 s against 2.8 on a 2-vCPU Xeon
    with AMX); balanced by bytes, the build takes ~3.7 s there.
    """
    ordered = sorted(sources, key=lambda src: (-src.stat().st_size, src.name))
    count = max(1, min(workers, len(ordered)))
    units: list[list[Path]] = [[] for _ in range(count)]
    sizes = [0] * count
    for src in ordered:
        i = min(range(count), key=lambda u: (sizes[u], u))
        units[i].append(src)
        sizes[i] += src.stat().st_size
    return [unit for unit in units if unit]


def _build(compiler: str, target: Path) -> None:
    """Compile the sources in `compile_units`, as many at once as this process may use
    CPUs (the largest unit first: a first start-up waits for the slowest), then link them
    into `target`. A unit of several sources is a file that #includes them, so their
    `static` names must differ (a clash fails the build, and the tests build it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    workers = max(1, len(cpu_threads.allowed_cpus()))
    # build beside the target, then rename: concurrent processes never load a half-written file
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        jobs, objects = [], []
        for i, unit in enumerate(compile_units(SOURCES, workers)):
            source = unit[0]
            if len(unit) > 1:  # each source includes pd_kernels.h beside it, found from its own path
                source = Path(work) / f"unit{i}.c"
                source.write_text("".join(f'#include "{src}"\n' for src in unit))
            objects.append(Path(work) / f"unit{i}.o")
            jobs.append([compiler, *compile_flags(), "-c", str(source), "-o", str(objects[-1])])
        with ThreadPoolExecutor(max_workers=min(len(jobs), workers)) as pool:
            list(pool.map(_run_compiler, jobs))  # re-raises the first failure
        library = Path(work) / target.name
        _run_compiler([compiler, *map(str, objects), *LINK_FLAGS, "-o", str(library)])
        os.replace(library, target)


def prepare(device: torch.device) -> None:
    """Build (or find) the library for a CPU engine: the native ops' `OpImpl.prepare`, which
    the engine runs in the background while it reads the model's config and tokenizer, so a
    first start-up on a machine does not wait for the compiler after them."""
    if device.type == "cpu":
        kernels()


def switched_on() -> bool:
    """False when `PAGEDLLM_CPU_KERNELS` turns the CPU fast paths (native kernels and
    oneDNN-packed weights, see dense.py) off."""
    return envs.get("PAGEDLLM_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


_BUILD_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def kernels() -> ctypes.CDLL | None:
    """The loaded library, or None when the native path is off or cannot be built here. A
    caller that arrives while another thread builds it (the engine's background `prepare`)
    waits for that build and gets its library."""
    with _BUILD_LOCK:
        return _load_library()


def forget_kernels() -> None:
    """Drop the loaded library, so the next `kernels()` finds or builds it again (tests)."""
    kernels.cache_clear()
    _load_library.cache_clear()


@functools.lru_cache(maxsize=1)
def _load_library() -> ctypes.CDLL | None:
    if not switched_on():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: the native CPU kernels are off (install gcc for a faster CPU path)")
        return None
    target = _library_path(compiler)
    try:
        if not target.exists():
            logger.info("building native CPU kernels -> %s", target)
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        logger.warning("native CPU kernels unavailable, using torch ops instead: %s", exc)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.pd_abi_version() != ABI_VERSION:
        logger.warning("native CPU kernels: ABI mismatch, using torch ops instead")
        return None
    logger.info("native CPU kernels for %s%s", features.detect().summary(),
                "" if lib.pd_has_avx2() else " (portable build: no AVX2 path)")
    return lib


def available() -> bool:
    return kernels() is not None


class _Recorder:
    """Stands in for the library while a step is recorded: runs each call and logs it
    as (kernel name, function, arguments, return value)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.calls: list[tuple[str, Any, tuple, Any]] = []

    def __getattr__(self, name: str):
        fn = getattr(self.lib, name)

        def call(*args):
            rc = fn(*args)
            self.calls.append((name, fn, args, rc))
            return rc

        return call


class _Recording(threading.local):
    """The recorder of the step this thread records, if any: per thread, so that engines
    stepping in other threads (data-parallel replicas) are neither recorded nor stopped."""

    recorder: "_Recorder | None" = None


_recording = _Recording()


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, Any, tuple, Any]]]:
    """Within the block, every kernel call this thread makes through the wrappers below
    runs and is also appended to the yielded list as (kernel name, ctypes function,
    arguments, return value): what a step replayer needs to call them again. Not
    re-entrant."""
    if _recording.recorder is not None:
        raise RuntimeError("native.recording() is already active")
    lib = kernels()
    if lib is None:
        raise RuntimeError("native.recording(): the native CPU kernels are not available here")
    _recording.recorder = recorder = _Recorder(lib)
    try:
        yield recorder.calls
    finally:
        _recording.recorder = None


def pointer_args(kernel: str) -> list[int]:
    """Positions of the pointer arguments of `kernel` (those a replay may re-point)."""
    return [i for i, kind in enumerate(_SIGNATURES[kernel][1]) if kind is ctypes.c_void_p]


REPLAY_ARGS = 20  # PD_REPLAY_ARGS in csrc/replay.c
_KIND = {_p: "p", _i64: "i", _i32: "i", _f32: "f"}


class _Word(ctypes.Union):
    _fields_ = [("i", ctypes.c_int64), ("f", ctypes.c_double)]


class ReplayCall(ctypes.Structure):
    """One call of a recorded step as csrc/replay.c's pd_call lays it out."""

    _fields_ = [("kernel", ctypes.c_int32), ("check", ctypes.c_int32), ("rc", ctypes.c_int64),
                ("args", _Word * REPLAY_ARGS), ("patch", ctypes.c_int32 * REPLAY_ARGS)]


@functools.lru_cache(maxsize=None)
def _replay_id(name: str) -> int | None:
    """csrc/replay.c's id for kernel `name`, None where it is not replayed there. Raises
    if the two sides disagree on its arguments (a signature changed on one side only)."""
    lib = kernels()
    kinds = ctypes.create_string_buffer(REPLAY_ARGS + 1)
    kernel = lib.pd_replay_kernel(name.removeprefix("pd_").encode(), kinds)
    if kernel < 0:
        return None
    ours = "".join(_KIND[a] for a in _SIGNATURES[name][1])
    if kinds.value.decode() != ours or lib.pd_replay_call_size() != ctypes.sizeof(ReplayCall):
        raise RuntimeError(f"csrc/replay.c and native.py disagree on {name}: {kinds.value.decode()!r} "
                           f"against {ours!r}")
    return kernel


class ReplayProgram:
    """Recorded kernel calls that `run` replays in one call into the library (pd_replay),
    the GIL released for the whole of it. Each call is (kernel name, arguments as recorded,
    patches: (argument position, step input index, offset from that input's address),
    recorded return value). `build` returns None when a call's kernel is not replayed in C."""

    def __init__(self, calls: "ctypes.Array[ReplayCall]") -> None:
        self.calls = calls

    @classmethod
    def build(cls, calls: Sequence[tuple[str, tuple, Sequence[tuple[int, int, int]], Any]]) -> "ReplayProgram | None":
        program = (ReplayCall * len(calls))()
        for slot, (name, args, patches, rc) in zip(program, calls):
            kernel = _replay_id(name)
            if kernel is None:
                return None
            slot.kernel, slot.check, slot.rc = kernel, rc is not None, rc or 0
            slot.patch[:] = [-1] * REPLAY_ARGS  # every slot unpatched, those past the kernel's arguments too
            for i, (value, kind) in enumerate(zip(args, _SIGNATURES[name][1])):
                if kind is _f32:
                    slot.args[i].f = value
                else:
                    slot.args[i].i = value or 0  # None: a NULL pointer
            for i, source, offset in patches:
                slot.args[i].i, slot.patch[i] = offset, source
        return cls(program)

    def run(self, bases: "ctypes.Array[ctypes.c_int64]", start: int = 0, end: int | None = None) -> int:
        """Runs calls [start, end) with the step inputs at `bases`; -1, or the index of the
        first call that returned other than its recording (the ones after it did not run)."""
        end = len(self.calls) if end is None else end
        if end <= start:
            return -1
        failed = kernels().pd_replay(ctypes.addressof(self.calls[start]), end - start, ctypes.addressof(bases))
        return -1 if failed < 0 else start + failed


def _lib():
    recorder = _recording.recorder
    return recorder if recorder is not None else kernels()


def _ptr(t: torch.Tensor, name: str, dtype: torch.dtype) -> int:
    """The address of a contiguous CPU tensor of `dtype` (the cheapest checks first: this
    runs a few hundred times per decode step)."""
    if t.dtype is not dtype or not t.is_cpu or not t.is_contiguous():
        if t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError(f"{name}: expected a CPU {dtype} tensor, got {t.device} {t.dtype}")
        raise ValueError(f"{name}: expected a contiguous tensor")
    return t.data_ptr()


@dataclass(frozen=True)
class PackedWeight:
    """A ggml-quantized [N, K] matrix repacked for `linear` (see pd_repack): the codes,
    and float32 scales d and offsets m per 32-value block (m is empty for Q8_0)."""

    qtype: int
    n: int
    k: int
    codes: torch.Tensor  # uint8 [N, K/32 * (16 | 32)]
    d: torch.Tensor  # float32 [N, K/32]
    m: torch.Tensor  # float32 [N, K/32], or [0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m))

    @functools.cached_property
    def pointers(self) -> tuple[int, int, int | None]:
        """Addresses of codes, d and m (None for Q8_0), looked up once."""
        return self.codes.data_ptr(), self.d.data_ptr(), self.m.data_ptr() if self.m.numel() else None


def _check_raw(raw: torch.Tensor, qtype: int, k: int, types: dict[int, str] = SUPPORTED_QTYPES) -> None:
    values, nbytes = _BLOCKS.get(qtype, (32, 0))
    if qtype not in types or k % values:
        raise ValueError(f"this kernel reads {sorted(types.values())} with K a multiple of their blocks (32 values, "
                         f"256 for K-quants); got ggml type {qtype}, K={k}")
    row_bytes = k // values * nbytes
    if raw.dim() != 2 or raw.shape[1] != row_bytes or raw.dtype != torch.uint8:
        raise ValueError(f"raw: expected [N, {row_bytes}] uint8 bytes for {types[qtype]} rows of K={k}, "
                         f"got {raw.dtype} {list(raw.shape)}")


def pack(raw: torch.Tensor, qtype: int, k: int) -> PackedWeight:
    """Repack raw ggml blocks [N, bytes_per_row] of a [N, k] matrix."""
    _check_raw(raw, qtype, k)
    n, nblocks = raw.shape[0], k // 32
    codes = torch.empty(n, nblocks * (32 if qtype == 8 else 16), dtype=torch.uint8)
    d = torch.empty(n, nblocks, dtype=torch.float32)
    m = torch.empty(n, nblocks, dtype=torch.float32) if qtype != 8 else torch.empty(0, dtype=torch.float32)
    raw = raw.contiguous()  # held here: a temporary would be freed before C reads it
    if kernels().pd_repack(qtype, _ptr(raw, "raw", torch.uint8), n, k, codes.data_ptr(), d.data_ptr(),
                           m.data_ptr() if m.numel() else None) != PD_OK:
        raise ValueError(f"pd_repack: ggml type {qtype} or K={k} not supported")
    return PackedWeight(qtype, n, k, codes, d, m)


def _output(out: torch.Tensor | None, m: int, n: int) -> torch.Tensor:
    """A new float32 [m, n] output, or `out` checked to be one: a column slice of a wider
    float32 output is fine (the kernels honour its row stride)."""
    if out is None:
        return torch.empty(m, n, dtype=torch.float32)
    if out.dtype != torch.float32 or out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"out: expected a float32 [{m}, {n}] view with unit column stride")
    return out


def linear(x: torch.Tensor, w: PackedWeight, out: torch.Tensor | None = None, gemm: bool = False) -> torch.Tensor:
    """x [M, K] float32 (contiguous) @ W^T -> [M, N]. `out` may be a column slice of a
    wider [M, *] float32 output (its row stride is honoured). `gemm`: decode W panel by
    panel into the float32 GEMM (pd_linear_packed_gemm: for many rows, where decoding
    each weight once per row block beats streaming the codes per row)."""
    lib = _lib()
    m, k = x.shape
    if k != w.k:
        raise ValueError(f"x has {k} columns, the weight {w.k}")
    out = _output(out, m, w.n)
    name = "pd_linear_packed_gemm" if gemm else "pd_linear_packed"
    rc = getattr(lib, name)(w.qtype, _ptr(x, "x", torch.float32), m, k, *w.pointers, w.n, out.data_ptr(),
                            out.stride(0))
    if rc == PD_ENOMEM:
        raise MemoryError(f"{name}: out of memory for {m}x{k} activations")
    if rc != PD_OK:
        raise ValueError(f"{name}: ggml type {w.qtype} or K={k} not supported")
    return out


@dataclass(frozen=True)
class Lut4Weight:
    """A [N, K] matrix of 4-bit codebook codes (bitsandbytes NF4 / FP4) for `lut4_linear`:
    w[n, k] = lut[code] * absmax[n, k // block]."""

    n: int
    k: int
    block: int
    codes: torch.Tensor  # uint8 [N, K / 2]: element 2j in byte j's low nibble, 2j + 1 in its high one
    lut: torch.Tensor  # float32 [16]
    absmax: torch.Tensor  # float32 [N, K / block]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.lut, self.absmax))


def pack_lut4(codes: torch.Tensor, lut: torch.Tensor, absmax: torch.Tensor) -> Lut4Weight:
    """codes [N, K] (0..15), lut [16], absmax [N, K / block] -> the kernel's operands."""
    n, k = codes.shape
    block = k // absmax.shape[1]
    if block * absmax.shape[1] != k or block % 16 or absmax.shape[0] != n or lut.numel() != 16:
        raise ValueError(f"lut4: codes {tuple(codes.shape)}, absmax {tuple(absmax.shape)}, lut {lut.numel()}: "
                         "need absmax [N, K / block] with block a multiple of 16, and 16 values")
    pairs = codes.to(torch.uint8).view(n, k // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    return Lut4Weight(n, k, block, packed, lut.float().contiguous(), absmax.float().contiguous())


def lut4_linear(x: torch.Tensor, w: Lut4Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 (contiguous) @ W^T -> [M, N]; `out` may be a column slice."""
    m, k = x.shape
    if k != w.k:
        raise ValueError(f"x has {k} columns, the weight {w.k}")
    out = _output(out, m, w.n)
    rc = _lib().pd_linear_lut4(_ptr(x, "x", torch.float32), m, k, w.codes.data_ptr(), w.lut.data_ptr(),
                               w.absmax.data_ptr(), w.block, w.n, out.data_ptr(), out.stride(0))
    if rc != PD_OK:
        raise ValueError(f"pd_linear_lut4: block {w.block} or K={k} not supported")
    return out


@dataclass(frozen=True)
class DenseWeight:
    """A float32 [N, K] matrix in pd_sgemm's layout: panels of 16 columns, [ceil(N/16), K, 16]."""

    n: int
    k: int
    panels: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


def pack_dense(weight: torch.Tensor) -> DenseWeight:
    """Pack a float32 CPU weight [N, K] once, for `dense_linear`."""
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [N, K], got {list(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().contiguous()
    panels = torch.empty((n + 15) // 16, k, 16, dtype=torch.float32)
    kernels().pd_sgemm_pack(_ptr(w, "weight", torch.float32), n, k, panels.data_ptr())
    return DenseWeight(n, k, panels)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., k] as rows [M, k] the GEMM kernels read (unit column stride, any row
    stride): x itself when it already is, else a contiguous copy."""
    return x if x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= k else x.reshape(-1, k).contiguous()


def dense_linear(x: torch.Tensor, w: DenseWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 @ W^T (+ bias) -> [..., N]."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != w.k:
        raise ValueError(f"x: expected a CPU float32 [..., {w.k}], got {x.device} {x.dtype} {list(x.shape)}")
    lead = x.shape[:-1]
    x2 = _rows(x, w.k)
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (w.n,)):
        raise ValueError(f"bias: expected float32 [{w.n}], got {bias.dtype} {list(bias.shape)}")
    b = None if bias is None else _ptr(bias, "bias", torch.float32)
    m = x2.shape[0]
    out = torch.empty(m, w.n, dtype=torch.float32)
    if _lib().pd_sgemm(x2.data_ptr(), x2.stride(0), m, w.k, w.panels.data_ptr(), w.n, b, out.data_ptr(), w.n) != PD_OK:
        raise MemoryError(f"pd_sgemm: out of memory packing {m}x{w.k} activations")
    return out.view(*lead, w.n)


@dataclass(frozen=True)
class DenseExperts(DenseWeight):
    """A MoE layer's stacked float32 experts [E, N, K], each in pd_sgemm's panels:
    [E, ceil(N/16), K, 16]."""

    @property
    def e(self) -> int:
        return self.panels.shape[0]


MOE_MAX_TOP_K = 64  # PD_MOE_MAX_K in csrc/moe.c
MOE_ACTIVATIONS = {"silu": 0, "gelu": 1}


def pack_experts(weights: torch.Tensor) -> DenseExperts:
    """Pack stacked float32 CPU expert weights [E, N, K] once, for `moe_f32`."""
    if weights.dim() != 3:
        raise ValueError(f"expert weights: expected [E, N, K], got {list(weights.shape)}")
    e, n, k = weights.shape
    w = weights.detach().contiguous()
    _ptr(w, "expert weights", torch.float32)
    panels = torch.empty(e, (n + 15) // 16, k, 16, dtype=torch.float32)
    for i in range(e):
        kernels().pd_sgemm_pack(w[i].data_ptr(), n, k, panels[i].data_ptr())
    return DenseExperts(n, k, panels)


def moe_f32(x: torch.Tensor, w13: DenseExperts, w2: DenseExperts, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The routed experts' gated MLP (ops.fused_moe's contract) for float32 x [T, H], with
    w13 = pack_experts([E, 2I, H]) and w2 = pack_experts([E, H, I])."""
    t, h = x.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or h != w13.k or w2.n != h or w13.n != 2 * w2.k \
            or w13.e != w2.e:
        raise ValueError(f"moe_f32: x {x.dtype} {list(x.shape)} does not fit experts w13 "
                         f"[{w13.e}, {w13.n}, {w13.k}], w2 [{w2.e}, {w2.n}, {w2.k}]")
    if activation not in MOE_ACTIVATIONS:
        raise NotImplementedError(f"MoE activation {activation!r} is not supported (silu, gelu)")
    k = topk_ids.shape[-1]
    if topk_ids.shape != (t, k) or topk_weights.shape != (t, k) or k > MOE_MAX_TOP_K:
        raise ValueError(f"moe_f32: routing of shape {list(topk_ids.shape)} / {list(topk_weights.shape)} for "
                         f"{t} tokens (at most {MOE_MAX_TOP_K} experts per token)")
    rows = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(t, h, dtype=torch.float32)
    status = _lib().pd_moe_f32(rows.data_ptr(), t, h, ids.data_ptr(), weights.data_ptr(), k, w13.e,
                               w13.panels.data_ptr(), w2.panels.data_ptr(), w2.k, MOE_ACTIVATIONS[activation],
                               out.data_ptr())
    if status == PD_EINVAL:
        raise ValueError(f"moe_f32: an expert id outside [0, {w13.e}) has a nonzero weight")
    if status != PD_OK:
        raise MemoryError(f"pd_moe_f32: out of memory for {t} tokens x {k} experts")
    return out


@dataclass(frozen=True)
class Bf16Tiles:
    """A [N, K] matrix as bf16 tiles (layout: csrc/amx.c) for `bf16_tiles_linear`: AMX reads
    them as tiles, AVX512-BF16 (csrc/bf16dot.c) as 16-column pair vectors."""

    n: int
    k: int
    tiles: torch.Tensor  # int16 [ceil(N/16) * ceil(K/32) * 512]

    @property
    def nbytes(self) -> int:
        return self.tiles.numel() * self.tiles.element_size()


def amx_available() -> bool:
    """True where the library was built with AMX-BF16 and Linux lets this process use the
    tiles (the kernel grants tile state on request, csrc/amx.c)."""
    lib = kernels()
    return lib is not None and bool(lib.pd_has_amx())


def bf16dot_available() -> bool:
    """True where the library was built for a CPU with AVX512-BF16 (csrc/bf16dot.c)."""
    lib = kernels()
    return lib is not None and bool(lib.pd_has_bf16dot())


def bf16_tiles_kernel() -> str | None:
    """Which native kernel `bf16_tiles_linear` runs here: "amx-bf16", "avx512-bf16", or None."""
    if amx_available():
        return "amx-bf16"
    return "avx512-bf16" if bf16dot_available() else None


def pack_bf16_tiles(weight: torch.Tensor) -> Bf16Tiles:
    """A float or bf16 CPU weight [N, K] rounded to bf16 (nearest even) and tiled once, for
    `bf16_tiles_linear`."""
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [N, K], got {list(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().float().contiguous()
    tiles = torch.empty(kernels().pd_amx_packed_size(n, k), dtype=torch.int16)
    kernels().pd_amx_pack(w.data_ptr(), n, k, tiles.data_ptr())
    return Bf16Tiles(n, k, tiles)


def _tiles_bias(bias: torch.Tensor | None, w: Bf16Tiles) -> torch.Tensor | None:
    """The float32 bias [N] a bf16 tiles kernel adds (a bf16 one widened): the caller keeps
    the tensor alive while the kernel reads it."""
    if bias is not None and bias.shape != (w.n,):
        raise ValueError(f"bias: expected [{w.n}], got {list(bias.shape)}")
    return None if bias is None else bias.float()


def bf16_tiles_linear(x: torch.Tensor, w: Bf16Tiles, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype (float32 or bf16): bf16 products,
    float32 sums, one rounding of a bf16 output; on AMX tiles where this process has them,
    else AVX512-BF16."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or x.shape[-1] != w.k:
        raise ValueError(f"x: expected a CPU float32 or bf16 [..., {w.k}], got {x.device} {x.dtype} {list(x.shape)}")
    lead = x.shape[:-1]
    x2, bias = _rows(x, w.k), _tiles_bias(bias, w)
    b = None if bias is None else _ptr(bias, "bias", torch.float32)
    m, bf16 = x2.shape[0], x.dtype == torch.bfloat16
    out = torch.empty(m, w.n, dtype=x.dtype)
    kernel = _lib().pd_amx_linear if amx_available() else _lib().pd_bf16dot_linear
    rc = kernel(x2.data_ptr(), bf16, x2.stride(0), m, w.k, w.tiles.data_ptr(), w.n, b, out.data_ptr(), bf16, w.n)
    if rc == PD_EINVAL:
        raise RuntimeError("bf16_tiles_linear: this build or process has neither AMX nor AVX512-BF16 "
                           "(check bf16_tiles_kernel() first)")
    if rc != PD_OK:
        raise MemoryError(f"bf16_tiles_linear: out of memory rounding {m}x{w.k} activations to bf16")
    return out.view(*lead, w.n)


def bf16_tiles_silu_fits(x: torch.Tensor, w: Bf16Tiles) -> bool:
    """Whether `bf16_tiles_silu_and_mul` takes x and w: a native bf16 kernel here, float32 x,
    and gate and up halves of whole 16-column strips."""
    return x.dtype == torch.float32 and w.n % 32 == 0 and bf16_tiles_kernel() is not None


def bf16_tiles_silu_and_mul(x: torch.Tensor, w: Bf16Tiles, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u for [g | u] = x @ W^T (+ bias), W stacking the gate's N / 2 rows over the up
    projection's: x float32 [..., K] -> float32 [..., N / 2] in one pass (AMX tiles where this
    process has them, else AVX512-BF16), equal to `bf16_tiles_linear` followed by `silu_mul`
    without writing the [..., N] product."""
    if not bf16_tiles_silu_fits(x, w) or x.device.type != "cpu" or x.shape[-1] != w.k:
        raise ValueError(f"x: expected a CPU float32 [..., {w.k}] and a native bf16 kernel for whole 16-column "
                         f"strips per half, got {x.device} {x.dtype} {list(x.shape)}, N={w.n} "
                         "(check bf16_tiles_silu_fits() first)")
    lead, half = x.shape[:-1], w.n // 2
    x2, bias = _rows(x, w.k), _tiles_bias(bias, w)
    b = None if bias is None else _ptr(bias, "bias", torch.float32)
    m = x2.shape[0]
    out = torch.empty(m, half, dtype=torch.float32)
    kernel = _lib().pd_amx_linear_silu if amx_available() else _lib().pd_bf16dot_linear_silu
    rc = kernel(x2.data_ptr(), 0, x2.stride(0), m, w.k, w.tiles.data_ptr(), w.n, b, out.data_ptr(), half)
    if rc == PD_ENOMEM:
        raise MemoryError(f"bf16_tiles_silu_and_mul: out of memory rounding {m}x{w.k} activations to bf16")
    if rc != PD_OK:
        raise RuntimeError(f"bf16_tiles_silu_and_mul: the kernel refused (rc {rc})")
    return out.view(*lead, half)


@dataclass(frozen=True)
class QuantTiles:
    """A Q4_0 / Q4_1 / Q8_0 [N, K] matrix repacked for `quant_tiles_linear` (layout: csrc/amx.c),
    as many bytes as its blocks: dequantized into AMX tiles inside the GEMM."""

    qtype: int
    n: int
    k: int
    tiles: torch.Tensor  # uint8 [pd_amx_qt_packed_size]

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()


def quant_tiles_fit(qtype: int, n: int, k: int) -> bool:
    """Whether `pack_quant_tiles` takes a weight: a `SUPPORTED_QTYPES` type (those the native
    kernels read), N a multiple of 16, AMX here."""
    return qtype in SUPPORTED_QTYPES and n % 16 == 0 and k % 32 == 0 and amx_available()


def pack_quant_tiles(raw: torch.Tensor, qtype: int, k: int) -> QuantTiles:
    """ggml blocks (uint8 [N, bytes per row]) repacked for `quant_tiles_linear`."""
    _check_raw(raw, qtype, k)
    n = raw.shape[0]
    if not quant_tiles_fit(qtype, n, k):
        raise ValueError(f"pack_quant_tiles: a {n} x {k} {SUPPORTED_QTYPES.get(qtype, qtype)} weight does not fit "
                         "the AMX quantized tiles here (check quant_tiles_fit() first)")
    tiles = torch.empty(kernels().pd_amx_qt_packed_size(qtype, n, k), dtype=torch.uint8)
    if kernels().pd_amx_qt_pack(qtype, raw.contiguous().data_ptr(), n, k, tiles.data_ptr()) != PD_OK:
        raise ValueError(f"pack_quant_tiles: the kernel refused a {n} x {k} weight")
    return QuantTiles(qtype, n, k, tiles)


def quant_tiles_linear(x: torch.Tensor, w: QuantTiles, out: torch.Tensor | None = None,
                       silu_and_mul: bool = False) -> torch.Tensor:
    """x float32 [M, K] (rows contiguous) @ W^T -> float32 [M, N]: bf16 products of x rounded to
    bf16 and W's blocks dequantized in float32 and rounded to bf16, float32 sums; equal to
    `bf16_tiles_linear` on `pack_bf16_tiles` of W's float32 dequantization. With
    `silu_and_mul` (a gate/up weight, N / 2 a multiple of 16): silu(gate) * up, [M, N / 2],
    as `bf16_tiles_silu_and_mul` computes it."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.k or x.stride(1) != 1:
        raise ValueError(f"x: expected float32 [M, {w.k}] with contiguous rows, got {x.dtype} {list(x.shape)}")
    if silu_and_mul and w.n % 32:
        raise ValueError(f"silu_and_mul: the gate and up halves of {w.n} rows are not whole 16-column strips")
    m = x.shape[0]
    out = _output(out, m, w.n // 2 if silu_and_mul else w.n)
    kernel = _lib().pd_amx_qt_linear_silu if silu_and_mul else _lib().pd_amx_qt_linear
    rc = kernel(w.qtype, x.data_ptr(), x.stride(0), m, w.k, w.tiles.data_ptr(), w.n, out.data_ptr(), out.stride(0))
    if rc == PD_ENOMEM:
        raise MemoryError(f"quant_tiles_linear: out of memory for {m} x {w.k} activations")
    if rc != PD_OK:
        raise RuntimeError("quant_tiles_linear: this process has no AMX tiles (check quant_tiles_fit() first)")
    return out


@dataclass(frozen=True)
class VnniWeight:
    """A ggml Q4_0 / Q4_1 / Q8_0 / Q4_K [N, K] matrix in csrc/vnni.c's 16-column panels, for
    `vnni_linear`: the codes and the file's scales, about as many bytes as the blocks."""

    qtype: int
    n: int
    k: int
    panels: torch.Tensor  # uint8 [pd_vnni_packed_size]

    @property
    def nbytes(self) -> int:
        return self.panels.numel()


# pd_has_vnni's forms and pd_vnni_linear's flags (csrc/vnni.c)
_VNNI_FORMS = {1: "avx512", 2: "avx2", 3: "avx-vnni"}
_VNNI_INT8 = 1


def vnni_form() -> str | None:
    """The form of csrc/vnni.c's kernel this build has: "avx512" (AVX512-VNNI dot products),
    "avx2" (the same panels and numerics on AVX2's u8 x s8 pair products, for CPUs without
    AVX512-VNNI such as Zen 3), "avx-vnni" (that form on the 256-bit AVX-VNNI dot products),
    or None."""
    lib = kernels()
    return _VNNI_FORMS.get(lib.pd_has_vnni()) if lib is not None else None


def vnni_available() -> bool:
    """True where the library has a form of csrc/vnni.c's kernel (AVX512-VNNI or AVX2)."""
    return vnni_form() is not None


def pack_vnni(raw: torch.Tensor, qtype: int, k: int) -> VnniWeight:
    """Raw ggml blocks [N, bytes_per_row] of a [N, k] matrix (a `VNNI_QTYPES` type) in
    vnni.c's panel layout."""
    _check_raw(raw, qtype, k, VNNI_QTYPES)
    n = raw.shape[0]
    panels = torch.empty(kernels().pd_vnni_packed_size(qtype, n, k), dtype=torch.uint8)
    raw = raw.contiguous()
    if kernels().pd_vnni_pack(qtype, raw.data_ptr(), n, k, panels.data_ptr()) != PD_OK:
        raise ValueError(f"pd_vnni_pack: ggml type {qtype} or K={k} not supported")
    return VnniWeight(qtype, n, k, panels)


def vnni_reads(qtype: int, k: int) -> bool:
    """Whether `pack_vnni` takes rows of `k` values of this ggml type (K-quants: whole
    256-value super-blocks)."""
    return qtype in VNNI_QTYPES and k % _BLOCKS[qtype][0] == 0


def vnni_linear(x: torch.Tensor, w: VnniWeight, out: torch.Tensor | None = None, int8: bool = False) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> float32 [M, N] in this build's `vnni_form()`; `out` may be
    a column slice of a wider float32 output. Not float32-exact: each 32-value block of a row
    of x is rounded to integers of 1/8191 of its largest value (error at most 1/16382 of it,
    finer than bf16 above 1/32 of the block maximum), so it serves where bf16 products are
    allowed; the products and their sums are exact per block, then summed in float32 (both
    forms give the same integers; their float32 sums may differ in order).

    `int8`: the block rounded to integers of 1/127 of its largest value instead (error at
    most 1/254 of it: llama.cpp's Q8 activations), one u8 x s8 product per weight where
    the finer form takes two (csrc/vnni.c)."""
    m, k = x.shape
    if k != w.k:
        raise ValueError(f"x has {k} columns, the weight {w.k}")
    out = _output(out, m, w.n)
    rc = _lib().pd_vnni_linear(w.qtype, _VNNI_INT8 if int8 else 0, _ptr(x, "x", torch.float32), k, m, k,
                               w.panels.data_ptr(), w.n, out.data_ptr(), out.stride(0))
    if rc == PD_ENOMEM:
        raise MemoryError(f"pd_vnni_linear: out of memory for {m}x{k} activations")
    if rc != PD_OK:
        raise RuntimeError("pd_vnni_linear: this build has neither AVX512-VNNI nor AVX2 (check vnni_available() "
                           "first)")
    return out


def linear_groups(x: torch.Tensor, parts: Sequence[tuple[Any, int, int]], n: int,
                  fn: Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
    """x [M, K] float32 @ W^T for a weight kept as row groups `parts` [(weight, first row,
    end row)] in output order (a fused qkv / gate_up whose shards differ in type): one
    `fn(x, weight, out)` per group, each writing its column slice of one float32 [M, n]
    output; a single group returns fn's own output (`out` None)."""
    if len(parts) == 1:
        return fn(x, parts[0][0], None)
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for weight, start, end in parts:
        fn(x, weight, out[:, start:end])
    return out


def dequantize_rows(w: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a packed matrix as float32 [len(ids), K] (torch ops; for embedding lookups)."""
    codes, d = w.codes[ids], w.d[ids]
    t, nblocks = d.shape
    if w.qtype == 8:
        return (codes.view(torch.int8).float().view(t, nblocks, 32) * d[..., None]).view(t, w.k)
    codes = codes.view(t, nblocks, 16)
    q = torch.cat((codes & 0x0F, codes >> 4), dim=-1).float()
    return torch.addcmul(w.m[ids][..., None], q, d[..., None]).view(t, w.k)


def linear_q(x: torch.Tensor, raw: torch.Tensor, qtype: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` straight from raw ggml blocks [N, bytes_per_row] (repacks on every call:
    for tests and one-off use; layers pack once at load)."""
    return linear(x, pack(raw, qtype, x.shape[1]), out)


def dequantize(raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    out = torch.empty(n, k, dtype=torch.float32)
    if kernels().pd_dequantize(qtype, _ptr(raw, "raw", torch.uint8), n, k, out.data_ptr()) != PD_OK:
        raise ValueError(f"pd_dequantize: ggml type {qtype} or K={k} not supported")
    return out


# ggml K-quant ids (Q4_K, Q5_K, Q6_K) -> bytes per 256-value super-block, for `dequantize_k`
K_QUANT_BYTES = {qtype: _BLOCKS[qtype][1] for qtype in (12, 13, 14)}


def dequantize_k(raw: torch.Tensor, qtype: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Q4_K / Q5_K / Q6_K blocks (uint8, whole super-blocks, any shape) -> float32 [values],
    value for value what gguf_dequant.py's torch ops compute, into `out` where given."""
    if qtype not in K_QUANT_BYTES:
        raise ValueError(f"dequantize_k: ggml type {qtype} is not Q4_K, Q5_K or Q6_K")
    nblocks = raw.numel() // K_QUANT_BYTES[qtype]
    if raw.numel() != nblocks * K_QUANT_BYTES[qtype]:
        raise ValueError(f"dequantize_k: {raw.numel()} bytes are not whole blocks of {K_QUANT_BYTES[qtype]}")
    if out is None:
        out = torch.empty(nblocks * 256, dtype=torch.float32)
    elif out.numel() != nblocks * 256 or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"dequantize_k: out must be {nblocks * 256} contiguous float32 values")
    raw = raw.contiguous()  # held here while the kernel reads it
    kernels().pd_dequantize_k(qtype, _ptr(raw, "raw", torch.uint8), nblocks, out.data_ptr())
    return out


def q4_k_as_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks (uint8 [..., 144k]) -> their Q4_1 rewrite, uint8 [..., 160k] (see
    gguf_blocks32.q4_k_as_q4_1, whose values these are)."""
    q4_k, q4_1 = _BLOCKS[12][1], 8 * _BLOCKS[3][1]  # bytes of a super-block and of its eight blocks
    nblocks = raw.numel() // q4_k
    if raw.numel() != nblocks * q4_k:
        raise ValueError(f"q4_k_as_q4_1: {raw.numel()} bytes are not whole Q4_K blocks")
    out = torch.empty(*raw.shape[:-1], raw.shape[-1] // q4_k * q4_1, dtype=torch.uint8)
    raw = raw.contiguous()
    kernels().pd_q4_k_as_q4_1(_ptr(raw, "raw", torch.uint8), nblocks, out.data_ptr())
    return out


def as_q8_0(values: torch.Tensor) -> torch.Tensor:
    """float32 rows [N, K] (K a multiple of 32) -> Q8_0 rows uint8 [N, K / 32 * 34] (see
    gguf_blocks32.as_q8_0, whose values these are)."""
    n, k = values.shape
    out = torch.empty(n, k // 32 * 34, dtype=torch.uint8)
    values = values.contiguous()
    status = kernels().pd_as_q8_0(_ptr(values, "values", torch.float32), n * k // 32, out.data_ptr())
    if status == PD_EINVAL:
        raise ValueError("cannot re-quantize a weight holding NaN or infinity to Q8_0")
    if status == PD_ERANGE:
        raise ValueError("a weight block's magnitude is beyond f16's range: no Q8_0 scale for it")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """norm(x) * weight; with `residual`, residual += x (in place) and norm(residual) * weight."""
    t, h = x.shape
    out = torch.empty_like(x)
    res = 0 if residual is None else _ptr(residual, "residual", torch.float32)
    _lib().pd_rms_norm(_ptr(x, "x", torch.float32), res, _ptr(weight, "weight", torch.float32), out.data_ptr(),
                       t, h, eps)
    return out


def rope_neox_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate, in place, the first `num_heads` heads of each row of x [T, >= num_heads * D]
    (rows contiguous, any row stride); cos/sin [T, D/2] float32."""
    if x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[1] < num_heads * head_dim:
        raise ValueError("x: expected float32 [T, >= num_heads * head_dim] with contiguous rows")
    _lib().pd_rope_neox(x.data_ptr(), x.shape[0], x.stride(0), num_heads, head_dim,
                        _ptr(cos, "cos", torch.float32), _ptr(sin, "sin", torch.float32))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] of shape [T, 2I]."""
    t, two_i = x.shape
    out = torch.empty(t, two_i // 2, dtype=torch.float32)
    _lib().pd_silu_mul(_ptr(x, "x", torch.float32), out.data_ptr(), t, two_i // 2)
    return out


def bf16_kv_available() -> bool:
    """True where the library has the bf16-cache kernels (its 512-bit path: AVX-512 CPUs)."""
    lib = kernels()
    return lib is not None and bool(lib.pd_has_bf16_kv())


def attention_tiles(head_size: int, group: int) -> bool:
    """True where `paged_attention` takes prefill chunks (16 query rows or more) 16 rows at
    a time for heads of `head_size` with `group` query heads per kv head, in a layer
    without a soft cap: 2.2-2.8x faster than torch's SDPA at 1024-4096 causal tokens."""
    lib = kernels()
    return lib is not None and bool(lib.pd_attention_tiles(head_size, group))


_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def _cache_dtype(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.dtype:
    if key_cache.dtype not in _CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"caches: expected both float32 or both bf16, got {key_cache.dtype} and {value_cache.dtype}")
    return key_cache.dtype


def write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store float32 k, v [T, kvh, D] (token stride free, rows contiguous) at cache `slots`
    [T] int64; a bf16 cache gets each value rounded to the nearest bf16."""
    t, kvh, d = k.shape
    for name, x in (("k", k), ("v", v)):
        if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError(f"{name}: expected float32 [T, kvh, D] with contiguous rows")
    dtype = _cache_dtype(key_cache, value_cache)
    fn = _lib().pd_write_kv if dtype == torch.float32 else _lib().pd_write_kv_bf16
    fn(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), _ptr(key_cache, "key_cache", dtype),
       _ptr(value_cache, "value_cache", dtype), _ptr(slots, "slots", torch.int64), t, kvh * d)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start: torch.Tensor, row_start: torch.Tensor, out: torch.Tensor,
                    scale: float, window: int, soft_cap: float) -> None:
    """out[rows] = attention of q[rows] over the paged cache (see pd_paged_attention).

    q [T, H, D] float32 with contiguous rows (token stride free); caches [blocks,
    block_size, kvh, D] float32, or bf16 where `bf16_kv_available()` and D % 16 == 0;
    block_tables [R, max_blocks], seq_lens [R], query_start [R + 1], row_start [R] int32.
    """
    _, h, d = q.shape
    if q.device.type != "cpu" or q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d:
        raise ValueError("q: expected a CPU float32 [T, H, D] with contiguous rows")
    if out.shape != q.shape:
        raise ValueError(f"out: expected q's shape {list(q.shape)}, got {list(out.shape)}")
    _, block_size, kvh, _ = key_cache.shape
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables: expected [R, max_blocks], got {list(block_tables.shape)}")
    dtype = _cache_dtype(key_cache, value_cache)
    fn = _lib().pd_paged_attention if dtype == torch.float32 else _lib().pd_paged_attention_bf16
    rc = fn(
        q.data_ptr(), q.stride(0), _ptr(key_cache, "key_cache", dtype),
        _ptr(value_cache, "value_cache", dtype), _ptr(block_tables, "block_tables", torch.int32),
        block_tables.stride(0), _ptr(seq_lens, "seq_lens", torch.int32), _ptr(query_start, "query_start", torch.int32),
        _ptr(row_start, "row_start", torch.int32), seq_lens.shape[0], _ptr(out, "out", torch.float32), h, kvh, d,
        block_size, scale, window, soft_cap)
    if rc == PD_ERANGE:
        raise ValueError(f"paged_attention: a seq_len is longer than its block-table row "
                         f"({block_tables.shape[1]} blocks of {block_size}) or shorter than its query")
    if rc == PD_EINVAL:
        raise ValueError(f"paged_attention: no bf16-cache kernel for head size {d} here (see bf16_kv_available)")
    if rc != PD_OK:
        raise MemoryError("pd_paged_attention: could not allocate the per-thread score rows")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index (its first NaN's, where it has one) of a float32
    [rows, cols] tensor with contiguous rows -> int64 [rows], as x.max(dim=-1).indices."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"argmax_rows: expected a CPU float32 [rows, cols] with contiguous rows, got "
                         f"{x.dtype} {list(x.shape)} strides {x.stride()}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().pd_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] for a float32 or bf16 table [rows, ...] and int64 ids [n] -> float32 [n, ...]
    (a bf16 table's rows widened; one kernel call, so a recorded step replays it; see replay.py)."""
    if ids.dim() != 1:
        raise ValueError(f"ids: expected a 1-D tensor, got {list(ids.shape)}")
    out = torch.empty((ids.shape[0], *table.shape[1:]), dtype=torch.float32)
    rows = table.shape[0]
    bf16 = table.dtype == torch.bfloat16
    kernel = _lib().pd_gather_rows_bf16 if bf16 else _lib().pd_gather_rows
    table_ptr = _ptr(table, "table", torch.bfloat16 if bf16 else torch.float32)
    if kernel(table_ptr, rows, table.numel() // rows if rows else 0, _ptr(ids, "ids", torch.int64), ids.shape[0],
              out.data_ptr()) != PD_OK:
        raise IndexError(f"gather_rows: an id is outside [0, {rows})")
    return out
