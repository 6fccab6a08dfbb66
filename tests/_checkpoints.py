"""What the tests' checkpoint writers share: reading a float Hugging Face directory, and
writing a quantized copy beside a float one that holds the dequantized weights."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

LINEAR = re.compile(r"(.*\.(q|k|v|o|gate|up|down)_proj)\.weight$")  # the projections a quantizer takes


def float_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `src`'s safetensors files, as float32."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    return {name: t.float() for name, t in tensors.items()}


def split_linears(src: Path, skip: tuple[str, ...] = ()) -> tuple[dict, dict, list[tuple[str, str, torch.Tensor]]]:
    """(quant, dense, linears) for a checkpoint writer: `src`'s float tensors that stay
    float (not a LINEAR projection, or named with a `skip` entry) already in both dicts,
    and (name, module prefix, weight) of each projection left to quantize."""
    quant: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    linears = []
    for name, w in float_tensors(src).items():
        match = LINEAR.match(name)
        if not match or any(s in name for s in skip):
            quant[name] = dense[name] = w
        else:
            linears.append((name, match.group(1), w))
    return quant, dense, linears


def write_pair(src: Path, out: Path, ref: Path, quant: dict[str, torch.Tensor], dense: dict[str, torch.Tensor],
               quantization_config: dict[str, Any]) -> None:
    """`out`: `quant` with `quantization_config`; `ref`: `dense` as a plain float32 model;
    both with `src`'s config (torch_dtype float32) and tokenizer files."""
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)
    for d in (out, ref):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(f, d / f.name)
    (ref / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in dense.items()}, str(ref / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    save_file({k: v.contiguous() for k, v in quant.items()}, str(out / "model.safetensors"))
