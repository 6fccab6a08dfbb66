"""Built-in attention backends. Backend classes are light; kernels import on selection."""

from __future__ import annotations

from pagedllm import hookimpl


@hookimpl
def pagedllm_attention_backends():
    from pagedllm.plugins.attention.torch_ref import TorchBackend

    return {"TORCH": TorchBackend}
