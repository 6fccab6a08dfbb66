"""Built-in quantization plugins: quantizers and the checkpoint formats that need them.

Each table maps a public name to (module, class) under this package; a module is
imported when the plugin manager asks for the tables, so keep quantizer modules free of
heavy top-level imports (kernel libraries load inside `check`/`apply`). Add a quantizer
by adding one line to `_QUANT_METHODS`.
"""

from __future__ import annotations

import argparse
import importlib

from pagedllm import hookimpl

_QUANT_METHODS = {
    "gguf": ("gguf_linear", "GGUFConfig"),
    "awq": ("awq", "AWQConfig"),
    "gptq": ("gptq", "GPTQConfig"),
    "compressed-tensors": ("compressed_tensors", "CompressedTensorsConfig"),
    "fp8": ("fp8", "Fp8Config"),
    "bitsandbytes": ("bitsandbytes", "BitsAndBytesConfig"),
}
_CHECKPOINT_FORMATS = {
    "gguf": ("gguf", "GGUFFormat"),
    "bitsandbytes": ("bitsandbytes", "BitsAndBytesFormat"),
}


def _load(table: dict[str, tuple[str, str]]) -> dict[str, type]:
    return {name: getattr(importlib.import_module(f"{__name__}.{module}"), cls)
            for name, (module, cls) in table.items()}


@hookimpl
def pagedllm_quant_methods():
    return _load(_QUANT_METHODS)


@hookimpl
def pagedllm_checkpoint_formats():
    return _load(_CHECKPOINT_FORMATS)


@hookimpl
def pagedllm_add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gguf-keep-quantized", action="store_true", dest="gguf_keep_quantized", default=False,
        help="Keep GGUF weights only as quantized blocks (memory stays at the file's size; the native CPU "
             "kernels read Q4_0/Q4_1/Q8_0 directly, other types are dequantized per call). By default a dense "
             "float copy is made at load as well, for large batches.")
