"""A Hugging Face model with a real model's shape and random weights, for speed benchmarks
where the real weights cannot travel (the GPU machine takes 64 MiB per call; SmolLM2's
GGUF alone is 98 MB).

    python scripts/random_model.py OUT --like DIR [--set hidden_size=2048 ...] [--dtype bfloat16]

DIR holds the real model's config.json and tokenizer files (its weights are not read);
`--set` overrides config fields (JSON values). Speed does not depend on the weights' values:
benchmarks run with EOS ignored. Never use such a model for a correctness claim.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--like", type=Path, required=True, help="directory with config.json and tokenizer files")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="config override")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import transformers

    config = json.loads((args.like / "config.json").read_text())
    for item in args.set:
        key, _, value = item.partition("=")
        config[key] = json.loads(value)
    config["dtype"] = args.dtype
    cfg = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, args.dtype)).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.like / name).exists():
            shutil.copy(args.like / name, args.out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {cfg.model_type}, {params / 1e6:.0f}M parameters, {args.dtype}, random weights")


if __name__ == "__main__":
    main()
