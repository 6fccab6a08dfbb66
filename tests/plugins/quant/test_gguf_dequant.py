"""Our ggml dequantizers against the `gguf` package's reference implementation.

Types the package can quantize are checked on data it quantized itself; the K-quants
(which it can only dequantize) on random blocks whose fp16 scale fields hold sane values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm.plugins.quant import gguf_dequant as dq  # noqa: E402

T = gguf.GGMLQuantizationType
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
# type -> byte offsets of the fp16 scale fields inside one block
K_QUANT_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _check(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> None:
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    # The reference returns float types as float arrays; the file holds their bytes.
    got = dq.dequantize_numpy(np.ascontiguousarray(raw).view(np.uint8), int(qtype), shape).numpy()
    assert got.shape == expected.shape == shape
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_by_reference(qtype) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 512)) * rng.uniform(0.01, 3, (8, 1))).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    _check(raw, qtype, x.shape)


@pytest.mark.parametrize("qtype", list(K_QUANT_SCALES), ids=lambda t: t.name)
def test_random_k_quant_blocks(qtype) -> None:
    rng = np.random.default_rng(int(qtype))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 6, 4 * block_size
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
        scales = rng.uniform(-0.05, 0.05, blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    _check(blocks.reshape(rows, -1), qtype, (rows, cols))


def test_runs_on_torch_tensors_of_raw_rows() -> None:
    """Keep-quantized mode dequantizes uint8 row tensors directly (no numpy)."""
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, T.Q4_1)
    got = dq.dequantize(torch.from_numpy(raw.copy()), int(T.Q4_1), (4, 64))
    np.testing.assert_allclose(got.numpy(), gguf.quants.dequantize(raw, T.Q4_1), atol=1e-6)


def test_unsupported_type_names_it_and_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*IQ2_XXS.*supported: F32, F16"):
        dq.tensor_nbytes(int(T.IQ2_XXS), (4, 256), where="tensor 'blk.0.attn_q.weight'")


def test_row_not_a_whole_number_of_blocks() -> None:
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        dq.tensor_nbytes(int(T.Q4_K), (4, 100), where="tensor 'x'")
