"""Built-in attention backends. Backend classes are light; kernels import on selection.

Every module named here imports with torch alone: triton, flash-attn and flashinfer are
probed by each backend's `check()` and imported only by its builder/impl.
"""

from __future__ import annotations

from pagedllm import hookimpl


@hookimpl
def pagedllm_attention_backends():
    from pagedllm.plugins.attention.cpu_attn import CpuAttnBackend
    from pagedllm.plugins.attention.flash_attn import FlashAttnBackend
    from pagedllm.plugins.attention.flashinfer import FlashInferBackend
    from pagedllm.plugins.attention.torch_ref import TorchBackend
    from pagedllm.plugins.attention.triton_backend import TritonBackend

    return {
        "TORCH": TorchBackend,
        "CPU_ATTN": CpuAttnBackend,
        "TRITON": TritonBackend,
        "FLASH_ATTN": FlashAttnBackend,
        "FLASHINFER": FlashInferBackend,
    }
