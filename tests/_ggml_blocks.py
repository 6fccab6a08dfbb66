"""Random ggml blocks for kernel and format tests (test helper)."""

from __future__ import annotations

import torch

from pagedllm.plugins.quant.gguf_file import Q4_0, Q4_1, Q8_0

BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


def random_blocks(qtype: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k/32 * block bytes] random ggml blocks whose fp16 scales (and Q4_1 mins) are finite."""
    nb = n * k // 32
    raw = torch.randint(0, 256, (nb, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=gen)
    halves = torch.randn(nb, 2, generator=gen).half()
    raw[:, 0:2] = halves[:, 0:1].contiguous().view(torch.uint8)
    if qtype == Q4_1:
        raw[:, 2:4] = halves[:, 1:2].contiguous().view(torch.uint8)
    return raw.reshape(n, -1)
