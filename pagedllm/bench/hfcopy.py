"""A safetensors copy of a GGUF model, for peers that cannot read GGUF (vLLM CPU, transformers).

transformers dequantizes the GGUF (`from_pretrained(dir, gguf_file=...)`) and we save
the result with its tokenizer. The copy is cached (default `.peers/smollm2-hf/`) and
made once: a `source.json` beside it records which GGUF it came from, so a stale
copy is rebuilt rather than silently compared against a different model.

Run as `python -m pagedllm.bench.hfcopy [--gguf FILE] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DEFAULT_PEERS_DIR = Path(os.environ.get("PAGEDLLM_PEERS_DIR", ".peers"))


def default_hf_copy_dir() -> Path:
    return DEFAULT_PEERS_DIR / "smollm2-hf"


def _source_record(gguf: Path) -> dict[str, object]:
    st = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": st.st_size, "mtime": int(st.st_mtime)}


def is_current(out_dir: Path, gguf: Path) -> bool:
    """Whether `out_dir` already holds a complete copy of this GGUF."""
    marker = out_dir / "source.json"
    if not marker.exists() or not (out_dir / "config.json").exists():
        return False
    try:
        return json.loads(marker.read_text()) == _source_record(gguf)
    except (OSError, ValueError):
        return False


def make_hf_copy(gguf: str | Path | None = None, out_dir: str | Path | None = None,
                 dtype: str = "float32") -> Path:
    """Convert `gguf` (default: the bundled SmolLM2 GGUF) into an HF directory; returns it.

    float32 by default: the dequantized Q4 weights are then kept exactly, and each
    peer casts to its own compute dtype (bf16 for vLLM) as it loads.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.core.config import default_model

    src = Path(gguf or default_model())
    out = Path(out_dir) if out_dir is not None else default_hf_copy_dir()
    if is_current(out, src):
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                 dtype=getattr(torch, dtype))
    # The weights are dequantized on load; transformers still tags the model as
    # "gguf-quantized" and refuses to save it, so drop the tag (the copy is plain).
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "source.json").write_text(json.dumps(_source_record(src)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the bundled SmolLM2 GGUF).")
    parser.add_argument("--out", default=None, help=f"Output directory (default: {default_hf_copy_dir()}).")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    print(make_hf_copy(args.gguf, args.out, args.dtype))


if __name__ == "__main__":
    main()
