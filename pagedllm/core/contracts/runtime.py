"""How a step runs faster without the layers knowing: implementations of the layer ops
(`pagedllm.ops`) and graph runners (capture a step's forward once, replay it after)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from pagedllm.core.contracts.attention import AttentionBackend, AttentionContext, BatchLayout


@dataclass(frozen=True)
class OpImpl:
    """One implementation of a layer op of `pagedllm.ops` (rms_norm, rotary_qkv,
    silu_and_mul, gather_rows, pack_linear, pack_moe, ...; each op's docstring there is its contract).

    Offered through the `pagedllm_op_impls` hook. For each (device type, dtype) of an
    op's first tensor argument, the op uses the runnable implementation with the highest
    `priority`, chosen on first use and kept; the op's plain-torch reference (priority 0)
    runs where no other can.
    """

    op: str  # the op's name in pagedllm.ops
    name: str  # shown in logs, e.g. "cpu_native"
    fn: Callable[..., Any]  # the op's signature and semantics
    # reasons it cannot run on tensors of this device and dtype (empty: it can)
    check: Callable[[torch.device, torch.dtype], list[str]]
    priority: int = 10
    # one-time set-up for a device that takes seconds (the CPU plugin compiles its kernels):
    # the engine starts it in the background before it opens the model, so the plugin's
    # `check` and `fn` must wait for a set-up still running; None: nothing to set up
    prepare: Callable[[torch.device], None] | None = None


class GraphRunner(ABC):
    """Runs a step's forward faster than calling the model: captures it once per batch
    shape and replays it later (CUDA graphs on a GPU; recorded native kernel calls on the
    CPU). The worker builds the runnable one with the highest priority for its device
    after loading, unless --enforce-eager; without one, every step runs eagerly.
    """

    name: ClassVar[str]
    priority: ClassVar[dict[str, int]] = {}

    @classmethod
    @abstractmethod
    def check(cls, device: torch.device, backend: type[AttentionBackend]) -> list[str]:
        """Reasons it cannot run here (empty = it can). `backend.graph_support` says which
        steps the attention backend's metadata allows capturing."""

    def __init__(self, model: nn.Module, backend: type[AttentionBackend]) -> None:
        self.model = model
        self.backend = backend

    @abstractmethod
    def __call__(self, layout: BatchLayout, attn: AttentionContext) -> torch.Tensor:
        """Hidden states for the step, equal to `model(layout.input_ids, layout.positions,
        attn)`; steps it cannot replay it runs eagerly."""
