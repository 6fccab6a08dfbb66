"""The native CPU kernels as plugins: the layer ops on them (ops.py) and step replay
(replay.py), the CPU's counterpart of CUDA graphs. The kernels themselves are the
`pagedllm.ops.cpu` library."""

from __future__ import annotations

from pagedllm import hookimpl


@hookimpl
def pagedllm_op_impls():
    from pagedllm.plugins.cpu_native.ops import OP_IMPLS

    return OP_IMPLS


@hookimpl
def pagedllm_graph_runners():
    from pagedllm.plugins.cpu_native.replay import StepReplayer

    return {StepReplayer.name: StepReplayer}
