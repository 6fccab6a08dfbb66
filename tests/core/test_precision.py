"""The float32 matmul precision policy (core/precision.py): what `auto` resolves to for
each kind of load, the override, and the scope of `matmul_precision()`."""

from __future__ import annotations

import pytest
from pagedllm.core import precision


def test_auto_allows_bf16_products_only_for_quantized_checkpoints():
    assert precision.resolve(None, "auto", True)[0] == "medium", "GGUF under --dtype auto"
    assert precision.resolve("auto", "auto", False)[0] == "highest", "a float32 checkpoint is kept exact"
    assert precision.resolve(None, "float32", True) == ("highest", "--dtype float32")


def test_the_environment_overrides_and_bad_values_are_named():
    assert precision.resolve("medium", "float32", False)[0] == "medium"
    assert precision.resolve("highest", "auto", True)[0] == "highest"
    with pytest.raises(ValueError, match="PAGEDLLM_FLOAT32_MATMUL_PRECISION.*'low'"):
        precision.resolve("low", "auto", True)


def test_matmul_precision_is_scoped_and_nests():
    assert precision.float32_matmul_precision() == "highest"
    with precision.matmul_precision("medium"):
        assert precision.float32_matmul_precision() == "medium"
        with precision.matmul_precision("highest"):
            assert precision.float32_matmul_precision() == "highest"
        assert precision.float32_matmul_precision() == "medium"
    assert precision.float32_matmul_precision() == "highest"
    with pytest.raises(ValueError, match="one of highest, medium"):
        with precision.matmul_precision("tf32"):
            pass
