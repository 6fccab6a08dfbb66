"""One dispatch point for the ops the model layers call.

A layer calls `ops.rms_norm(x, ...)` and never asks which hardware it runs on. Each op
chooses an implementation once per (device type, dtype) of its first tensor argument —
the runnable one with the highest priority among those plugins offer through the
`pagedllm_op_impls` hook, else its plain-torch reference — logs the choice, and reuses
it on every later call (vLLM's CustomOp idea: pick the path once, not per call).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from pagedllm.core.contracts import OpImpl

logger = logging.getLogger("pagedllm")

# every op by name, so a plugin's OpImpl for an unknown op fails with the known names
OPS: dict[str, "Op"] = {}


class Op:
    """A layer op: one signature (its reference's), implementations chosen per device/dtype.

    Args:
        name: the op's public name (what an `OpImpl.op` names).
        reference: the plain-torch implementation; it defines the op's semantics, runs on
            every device and dtype, and is what other implementations are tested against.
    """

    def __init__(self, name: str, reference: Callable[..., Any]) -> None:
        if name in OPS:
            raise ValueError(f"op {name!r} is defined twice")
        self.name = name
        self.reference = reference
        self.__doc__ = reference.__doc__
        self._chosen: dict[tuple[str, torch.dtype], Callable[..., Any]] = {}
        OPS[name] = self

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        fn = self._chosen.get((x.device.type, x.dtype))
        if fn is None:
            fn = self._choose(x.device, x.dtype)
        return fn(x, *args, **kwargs)

    def impl_for(self, device: torch.device, dtype: torch.dtype) -> OpImpl | None:
        """The plugin implementation chosen for tensors of `device` and `dtype` (None: the
        torch reference)."""
        from pagedllm.core.plugins import get_registry

        _impls(self.name)  # refuses implementations of ops nobody defines
        return get_registry().op_impl(self.name, device, dtype)

    def _choose(self, device: torch.device, dtype: torch.dtype) -> Callable[..., Any]:
        impl = self.impl_for(device, dtype)
        where = f"{device.type}/{str(dtype).replace('torch.', '')}"
        logger.info("op %s on %s: %s", self.name, where, impl.name if impl else "torch reference")
        fn = impl.fn if impl is not None else self.reference
        self._chosen[(device.type, dtype)] = fn
        return fn


def _impls(op: str) -> list[OpImpl]:
    from pagedllm.core.plugins import get_registry

    table = get_registry().op_impls
    unknown = sorted(set(table) - set(OPS))
    if unknown:
        raise ValueError(f"plugins implement unknown ops {unknown}; pagedllm.ops defines: {', '.join(sorted(OPS))}")
    return table.get(op, [])


def reset() -> None:
    """Forget every choice (after the environment that steered them changed, e.g. in tests)."""
    for op in OPS.values():
        op._chosen.clear()


def chosen() -> dict[str, dict[str, str]]:
    """{op: {"device/dtype": implementation name}} of the choices made so far (for logs)."""
    out: dict[str, dict[str, str]] = {}
    for op in OPS.values():
        for (device, dtype), fn in op._chosen.items():
            name = "torch" if fn is op.reference else next(
                (i.name for i in _impls(op.name) if i.fn is fn), repr(fn))
            out.setdefault(op.name, {})[f"{device}/{str(dtype).replace('torch.', '')}"] = name
    return out
