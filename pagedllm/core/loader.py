"""Where a model's config, tokenizer and weights come from.

The core reads Hugging Face directories (config.json, tokenizer files, *.safetensors,
sharded or not); any other format (GGUF) comes from a `CheckpointFormat` plugin. The
result is a `ModelSource`, so the worker never asks which format it was.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from pagedllm.core.contracts import CheckpointFormat
from pagedllm.core.plugins import PluginRegistry


@dataclass
class ModelSource:
    path: str
    hf_config: Any
    tokenizer: Any
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    quantization: str | None
    quantization_config: dict[str, Any]
    format_name: str


class HFDirectory(CheckpointFormat):
    """A Hugging Face model directory with safetensors weights."""

    name = "safetensors"

    @classmethod
    def detect(cls, path: str) -> bool:
        return os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json"))

    def hf_config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.options.get("tokenizer") or self.path)

    def weight_files(self) -> list[str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        else:
            names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not names:
            raise ValueError(f"{self.path} has no *.safetensors weights; convert the checkpoint to safetensors "
                             "(transformers: model.save_pretrained(dir, safe_serialization=True))")
        return [os.path.join(self.path, n) for n in names]

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.weight_files():
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def quantization(self) -> str | None:
        return None


def open_model(path: str, load_format: str, registry: PluginRegistry, options: dict[str, Any],
               tokenizer: str | None = None) -> ModelSource:
    """Open `path` with the format that fits it (plugins first when load_format is auto)."""
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist (pagedllm reads local files; it does not "
                         "download from a model hub)")
    fmt = registry.checkpoint_format(load_format, path, options)
    if fmt is None:
        if not HFDirectory.detect(path):
            known = ", ".join(sorted(registry.checkpoint_formats)) or "none"
            raise ValueError(f"{path!r} is neither a Hugging Face model directory (with config.json) nor a file "
                             f"of a known format (plugins: {known}); pass --load-format to force one")
        fmt = HFDirectory(path, options)
    if tokenizer:
        fmt.options["tokenizer"] = tokenizer
    hf_config = fmt.hf_config()
    quant_config = dict(getattr(hf_config, "quantization_config", None) or {})
    quant = quant_config.get("quant_method") or fmt.quantization()
    tok = _tokenizer(fmt, tokenizer)
    return ModelSource(path=path, hf_config=hf_config, tokenizer=tok, weights=fmt.weights,
                       quantization=quant, quantization_config=quant_config, format_name=fmt.name)


def _tokenizer(fmt: CheckpointFormat, tokenizer: str | None) -> Any:
    if tokenizer and not isinstance(fmt, HFDirectory):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    return fmt.tokenizer()
