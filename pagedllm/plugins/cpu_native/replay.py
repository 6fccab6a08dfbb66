"""Step replay: what CUDA graphs do on a GPU, for the CPU kernels.

A single-sequence decode step of a small model spends about half its time in Python
between kernels: module calls, argument checks, views, allocations (SmolLM2 on two
Zen 3 cores: 26 ms eager, 13 ms replayed). When a step's forward is nothing but native
kernel calls (pagedllm/ops/cpu/native.py) on tensors whose shapes depend only on the batch
shape, the calls and their arguments can be recorded once and replayed on later steps
with the same shape: the only arguments that change are the addresses of the step's
inputs (token ids, positions and the attention metadata), patched in before each replay.

Recording runs the step eagerly inside `native.recording()`, which logs each kernel
call, under a torch function mode that keeps every tensor the forward makes
alive (the replay writes into them again) and logs every torch call that computes, in
order with the kernel calls. A forward made of kernel calls alone replays them with the
step inputs' addresses patched in, as one call into the library (`native.ReplayProgram`,
csrc/replay.c) that holds no GIL for the whole step; a graph with a kernel replay.c does not
know runs call by call from Python instead. A forward that also computes with torch ops (oneDNN's
bf16 GEMMs, Qwen3's per-head norms) replays those too: the step's inputs are copied into
the recorded input tensors, each torch op is called again on its recorded arguments and
its result copied into its recorded output, so the kernels after it read the new values
(such a graph is kept only where its first replay beat the eager run, see DROP_SLOWER).
A torch call whose result is not a tensor (`.item()`, `.tolist()`, a tensor's truth value)
means the forward's Python depends on the data: such shapes stay eager. A graph is trusted only after
its first replay matched an eager run of the same step bit for bit (the same kernels in
the same order give the same bits); a mismatch turns replay off for the engine with a
warning. `--enforce-eager` never records. Only attention backends whose metadata allows
it (`graph_support`, CPU_ATTN's pure-decode steps) are replayed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from pagedllm.core.contracts import AttentionBackend, AttentionContext, BatchLayout, GraphRunner, GraphSupport
from pagedllm.ops.cpu import native

logger = logging.getLogger("pagedllm")

# torch calls that only ask about a tensor, allocate, or re-view memory: anything else
# computes (or may), which a replay of kernel calls would skip
QUERY_OPS = frozenset({
    "__get__", "data_ptr", "stride", "size", "dim", "numel", "element_size", "is_contiguous", "__len__",
    "untyped_storage", "storage_offset",
})
VIEW_OPS = frozenset({
    "view", "reshape", "contiguous", "__getitem__", "unsqueeze", "squeeze", "split", "narrow", "t", "transpose",
    "permute", "expand", "view_as", "select", "detach", "unbind", "flatten",
})
ALLOC_OPS = frozenset({"empty", "empty_like", "new_empty"})
# conversions that return their input itself when it already has the asked-for dtype and
# device (`.float()` of float32 activations before a kernel, `.to(x.dtype)` after one):
# then nothing was computed, and replaying them would only cost time (SmolLM2's 1-row
# decode step made 300 such calls, ~0.5 ms of a 4 ms step) and push the graph into the
# slower copy-the-inputs replay. Not every op returning its input qualifies: `add_` does too.
CONVERSION_OPS = frozenset({"to", "float", "double", "half", "bfloat16", "type", "type_as", "cpu"})

# Recorded steps of at most this many rows; graphs kept at once hold at most this many
# bytes of intermediate tensors (least recently used graphs are dropped first).
MAX_ROWS = 64
MAX_BYTES = 256 << 20
# Steps with longer queries run eagerly even where the backend's metadata would allow a
# capture: a decode has 1 query token per request, a speculative verify step 1 + k;
# prefill chunks rarely repeat a shape.
MAX_QUERY_LEN = 32
# A graph with torch ops is kept only if its first replay beat the eager run it is checked
# against: replaying re-runs each op and copies its result into the recorded tensor, and
# keeps every intermediate alive, which costs more than it saves once the ops dominate
# (SmolLM2 on 2 Sapphire Rapids cores: 4-row steps 1.4-1.9x faster replayed, 32-row steps
# 0.75x). Kernel-only graphs are always kept (measured faster at every row count).
DROP_SLOWER = True


class _Watch(TorchFunctionMode):
    """Keeps every tensor made during recording alive and logs the torch calls that
    compute, each with the number of kernel calls made before it (`calls`: the list
    `native.recording()` fills). A view op counts as one only if its result does not
    share its input's memory (`reshape`, `contiguous` and indexing copy when they must)."""

    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls
        self.keep: list[Any] = []
        self.data_dependent: set[str] = set()  # torch calls whose result is not a tensor
        self.ops: list[tuple[int, Any, tuple, dict, Any]] = []  # (kernel calls before it, func, args, kwargs, out)
        self.allocated = 0  # bytes of the tensors made here (views of weights and caches are free)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", repr(func))
        if name in QUERY_OPS:
            return out
        if name in CONVERSION_OPS and args and out is args[0]:
            return out
        if name in ALLOC_OPS and "out" not in kwargs:
            self.allocated += out.untyped_storage().nbytes()
        elif name in VIEW_OPS and "out" not in kwargs and args and isinstance(args[0], torch.Tensor) \
                and _shares(out, args[0].untyped_storage().data_ptr()):
            pass
        elif not _tensors(out):
            self.data_dependent.add(name)
        else:  # computes: run again on replay
            self.ops.append((len(self.calls), func, args, kwargs, out))
            self.allocated += sum(t.untyped_storage().nbytes() for t in _flat(out))
        self.keep.append(out)
        return out


def _flat(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _tensors(out: Any) -> bool:
    return all(isinstance(t, torch.Tensor) for t in _flat(out))


def _shares(out: Any, base: int) -> bool:
    return all(isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr() == base for r in _flat(out))


def step_inputs(layout: BatchLayout, metadata: Any) -> dict[str, torch.Tensor]:
    """The tensors a step's forward reads that are made anew each step: the token ids,
    positions and every tensor field of the backend's metadata."""
    inputs = {"input_ids": layout.input_ids, "positions": layout.positions}
    for field in dataclasses.fields(metadata):
        value = getattr(metadata, field.name)
        if isinstance(value, torch.Tensor):
            inputs[f"metadata.{field.name}"] = value
    return inputs


def step_key(inputs: dict[str, torch.Tensor], metadata: Any) -> tuple:
    """What must match for a recorded step to replay: every input's shape, strides and
    dtype, and the metadata's other fields (they may steer the forward's Python)."""
    shapes = tuple((name, tuple(t.shape), t.stride(), t.dtype) for name, t in inputs.items())
    others = tuple((f.name, repr(getattr(metadata, f.name))) for f in dataclasses.fields(metadata)
                   if not isinstance(getattr(metadata, f.name), torch.Tensor))
    return shapes + others


class StepGraph:
    """One recorded forward: the kernel calls (and the torch calls between them), where
    the step's inputs go, and the output tensor every replay rewrites."""

    def __init__(self, calls: list[tuple[str, Any, tuple, Any]], inputs: dict[str, torch.Tensor],
                 output: torch.Tensor, keep: list[Any], nbytes: int,
                 ops: list[tuple[int, Any, tuple, dict, Any]] | None = None) -> None:
        self.ops = ops or []
        # with torch calls, the inputs are copied into the recorded ones (torch calls read
        # those); kernel-only graphs re-point the kernels' arguments instead
        self.recorded_inputs = dict(inputs) if self.ops else {}
        names = list(inputs)
        ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), index)
                  for index, t in enumerate(inputs.values()) if t.numel()]
        self.calls = []
        for name, fn, args, rc in calls:
            patches = []
            for i in native.pointer_args(name) if not self.ops else ():
                value = args[i]
                owners = [(start, owner) for start, end, owner in ranges if value is not None and start <= value < end]
                if len(owners) > 1:
                    raise ValueError(f"{name}: argument {i} points into more than one step input")
                if owners:
                    patches.append((i, owners[0][1], value - owners[0][0]))
            self.calls.append((name, fn, args, patches, rc))
        self.input_names = names
        # the calls as one C program (pd_replay), when every kernel in it is replayed there
        self.program = native.ReplayProgram.build([(name, args, patches, rc)
                                                   for name, _, args, patches, rc in self.calls])
        self.bases = (ctypes.c_int64 * max(1, len(names)))()
        self.output = output
        self.keep = keep
        self.nbytes = nbytes
        self.verified = False

    def _run_calls(self, start: int, end: int, base: list[int]) -> None:
        if self.program is not None:
            failed = self.program.run(self.bases, start, end)
            if failed >= 0:
                raise RuntimeError(f"step replay: kernel {self.calls[failed][0]} returned other than its recording")
            return
        for name, fn, args, patches, rc in self.calls[start:end]:
            if patches:
                args = list(args)
                for i, source, offset in patches:
                    args[i] = base[source] + offset
            result = fn(*args)
            if result != rc:
                raise RuntimeError(f"step replay: kernel {name} returned {result} where its recording returned {rc}")

    def replay(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        base = [inputs[name].data_ptr() for name in self.input_names]
        self.bases[:len(base)] = base
        for name, recorded in self.recorded_inputs.items():
            if recorded is not inputs[name]:
                recorded.copy_(inputs[name])
        done = 0
        for position, func, args, kwargs, out in self.ops:
            self._run_calls(done, position, base)
            done = position
            new = func(*args, **kwargs)
            for old, fresh in zip(_flat(out), _flat(new)):
                if fresh is not old:
                    old.copy_(fresh)
        self._run_calls(done, len(self.calls), base)
        return self.output


class StepReplayer(GraphRunner):
    """Runs decode and speculative verify steps (up to MAX_QUERY_LEN query rows per
    request, as the backend's `graph_max_query_len` allows) through recorded graphs, one
    per batch shape, recorded the first time the shape is met; the replayer's very first
    forward runs eagerly instead, as a warm-up (what layers build on their first call,
    such as cached norm weights, must not be recorded). Other steps run eagerly.

    A shape used to be recorded on its second sight: every new batch size or block-table
    width then cost an eager step, a recording and a checked replay (which runs the step
    eagerly too) before it replayed, ~30-130 ms each at 32 SmolLM2 rows, paid again by
    every new batch size a server meets."""

    name = "cpu_replay"
    priority = {"cpu": 100}

    @classmethod
    def check(cls, device: torch.device, backend: type[AttentionBackend]) -> list[str]:
        reasons = []
        if device.type != "cpu":
            reasons.append("replays native CPU kernels only")
        if backend.graph_support is GraphSupport.NEVER:
            reasons.append(f"attention backend {backend.name} does not allow capturing steps")
        if not reasons and not native.available():
            reasons.append("native CPU kernels unavailable")
        return reasons

    def __init__(self, model: nn.Module, backend: type[AttentionBackend], max_rows: int = MAX_ROWS,
                 max_bytes: int = MAX_BYTES) -> None:
        super().__init__(model, backend)
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self.max_query_len = min(MAX_QUERY_LEN, backend.graph_max_query_len)
        self.graphs: OrderedDict[tuple, StepGraph | None] = OrderedDict()  # None: not replayable
        # the first forward runs eagerly, so that whatever a forward builds lazily on its
        # first call (cached norm weights) is not recorded
        self.warmed = False
        self.off = False
        self.said_why = False

    def __call__(self, layout: BatchLayout, attn: AttentionContext) -> torch.Tensor:
        rows = layout.input_ids.shape[0]
        if self.off or rows > self.max_rows or layout.max_query_len > self.max_query_len:
            return self.model(layout.input_ids, layout.positions, attn)
        inputs = step_inputs(layout, attn.metadata)
        key = step_key(inputs, attn.metadata)
        if key not in self.graphs:
            if not self.warmed:
                self.warmed = True
                return self.model(layout.input_ids, layout.positions, attn)
            return self._record(key, layout, attn, inputs)
        graph = self.graphs[key]
        if graph is None:
            return self.model(layout.input_ids, layout.positions, attn)
        self.graphs.move_to_end(key)
        start = time.perf_counter()
        out = graph.replay(inputs)
        if not graph.verified:
            replay_s = time.perf_counter() - start
            start = time.perf_counter()
            eager = self.model(layout.input_ids, layout.positions, attn)
            eager_s = time.perf_counter() - start
            if not torch.equal(eager, out):
                logger.warning("step replay: a replayed step differs from its eager run; replay is off from now on")
                self.off = True
                self.graphs.clear()
                return eager
            graph.verified = True
            if graph.ops and DROP_SLOWER and replay_s >= eager_s:
                self.graphs[key] = None  # this shape stays eager
                logger.debug("step replay: %d-row steps with torch ops replayed in %.1f ms, eagerly in %.1f ms: "
                             "kept eager", rows, replay_s * 1e3, eager_s * 1e3)
        return out

    def _record(self, key: tuple, layout: BatchLayout, attn: AttentionContext,
                inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        with native.recording() as calls:
            watch = _Watch(calls)
            with watch:
                out = self.model(layout.input_ids, layout.positions, attn)
        if watch.data_dependent or not calls:
            self.graphs[key] = None
            # said once: every batch shape of a model takes the same path
            (logger.debug if self.said_why else logger.info)(
                "step replay: %d-row decode steps run eagerly (the forward's Python reads tensor values: %s)",
                layout.input_ids.shape[0], ", ".join(sorted(watch.data_dependent)) or "no kernel calls")
            self.said_why = True
            return out
        if watch.allocated > self.max_bytes:
            self.graphs[key] = None  # alone over the budget: this shape stays eager
            return out
        self.graphs[key] = StepGraph(calls, inputs, out, watch.keep, watch.allocated, watch.ops)
        while sum(g.nbytes for g in self.graphs.values() if g is not None) > self.max_bytes and len(self.graphs) > 1:
            self.graphs.popitem(last=False)
        return out
