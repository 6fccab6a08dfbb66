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
alive (the replay writes into them again) and notes any torch call that computes. A
forward that computes with torch ops between kernels (a bias added by torch, a torch
fallback path) is not replayable: such shapes stay eager. A graph is trusted only after
its first replay matched an eager run of the same step bit for bit (the same kernels in
the same order give the same bits); a mismatch turns replay off for the engine with a
warning. `--enforce-eager` never records. Only attention backends whose metadata allows
it (`graph_support`, CPU_ATTN's pure-decode steps) are replayed.
"""

from __future__ import annotations

import dataclasses
import logging
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

# Recorded steps of at most this many rows; graphs kept at once hold at most this many
# bytes of intermediate tensors (least recently used graphs are dropped first).
MAX_ROWS = 64
MAX_BYTES = 256 << 20


class _Watch(TorchFunctionMode):
    """Keeps every tensor made during recording alive and notes the torch calls that
    compute. A view op counts as one only if its result shares its input's memory
    (`reshape`, `contiguous` and indexing copy when they must)."""

    def __init__(self) -> None:
        super().__init__()
        self.keep: list[Any] = []
        self.computed: set[str] = set()
        self.allocated = 0  # bytes of the tensors made here (views of weights and caches are free)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", repr(func))
        if name in QUERY_OPS:
            return out
        if name in ALLOC_OPS and "out" not in kwargs:
            self.allocated += out.untyped_storage().nbytes()
        elif name in VIEW_OPS and "out" not in kwargs and args and isinstance(args[0], torch.Tensor):
            base = args[0].untyped_storage().data_ptr()
            results = out if isinstance(out, (tuple, list)) else (out,)
            if not all(isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr() == base for r in results):
                self.computed.add(name)
        else:
            self.computed.add(name)
        self.keep.append(out)
        return out


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
    """One recorded forward: the kernel calls, where the step's inputs go in their
    arguments, and the output tensor every replay rewrites."""

    def __init__(self, calls: list[tuple[str, Any, tuple, Any]], inputs: dict[str, torch.Tensor],
                 output: torch.Tensor, keep: list[Any], nbytes: int) -> None:
        ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in inputs.items()
                  if t.numel()]
        self.calls = []
        for name, fn, args, rc in calls:
            patches = []
            for i in native.pointer_args(name):
                value = args[i]
                owners = [(start, owner) for start, end, owner in ranges if value is not None and start <= value < end]
                if len(owners) > 1:
                    raise ValueError(f"{name}: argument {i} points into more than one step input")
                if owners:
                    patches.append((i, owners[0][1], value - owners[0][0]))
            self.calls.append((fn, args, patches, rc))
        self.output = output
        self.keep = keep
        self.nbytes = nbytes
        self.verified = False

    def replay(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        base = {name: t.data_ptr() for name, t in inputs.items()}
        for fn, args, patches, rc in self.calls:
            if patches:
                args = list(args)
                for i, name, offset in patches:
                    args[i] = base[name] + offset
            result = fn(*args)
            if result != rc:
                raise RuntimeError(f"step replay: a kernel returned {result} where its recording returned {rc}")
        return self.output


class StepReplayer(GraphRunner):
    """Runs decode steps (one query row per request) through recorded graphs, one per
    batch shape, recording on the second sight (the first runs eagerly, as a warm-up);
    other steps run eagerly."""

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
        self.graphs: OrderedDict[tuple, StepGraph | None] = OrderedDict()  # None: not replayable
        # shapes seen once: a shape is recorded on its second step, so that whatever a
        # forward builds lazily on its first call (cached norm weights) is not recorded
        self.warmed: set[tuple] = set()
        self.off = False
        self.said_why = False

    def __call__(self, layout: BatchLayout, attn: AttentionContext) -> torch.Tensor:
        rows = layout.input_ids.shape[0]
        if self.off or layout.max_query_len != 1 or rows > self.max_rows:
            return self.model(layout.input_ids, layout.positions, attn)
        inputs = step_inputs(layout, attn.metadata)
        key = step_key(inputs, attn.metadata)
        if key not in self.graphs:
            if key not in self.warmed:
                self.warmed.add(key)
                return self.model(layout.input_ids, layout.positions, attn)
            return self._record(key, layout, attn, inputs)
        graph = self.graphs[key]
        if graph is None:
            return self.model(layout.input_ids, layout.positions, attn)
        self.graphs.move_to_end(key)
        out = graph.replay(inputs)
        if not graph.verified:
            eager = self.model(layout.input_ids, layout.positions, attn)
            if not torch.equal(eager, out):
                logger.warning("step replay: a replayed step differs from its eager run; replay is off from now on")
                self.off = True
                self.graphs.clear()
                return eager
            graph.verified = True
        return out

    def _record(self, key: tuple, layout: BatchLayout, attn: AttentionContext,
                inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        watch = _Watch()
        with native.recording() as calls, watch:
            out = self.model(layout.input_ids, layout.positions, attn)
        if watch.computed or not calls:
            self.graphs[key] = None
            # said once: every batch shape of a model takes the same path
            (logger.debug if self.said_why else logger.info)(
                "step replay: %d-row decode steps run eagerly (the forward computes with torch ops: %s)",
                layout.input_ids.shape[0], ", ".join(sorted(watch.computed)) or "no kernel calls")
            self.said_why = True
            return out
        if watch.allocated > self.max_bytes:
            self.graphs[key] = None  # alone over the budget: this shape stays eager
            return out
        self.graphs[key] = StepGraph(calls, inputs, out, watch.keep, watch.allocated)
        while sum(g.nbytes for g in self.graphs.values() if g is not None) > self.max_bytes and len(self.graphs) > 1:
            self.graphs.popitem(last=False)
        return out
