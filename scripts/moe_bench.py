"""MoE step time against a dense model with the same active parameters (issue 15's bar:
within 1.5x), measured with `pagedllm bench throughput`, alternating the two models in one
run so both see the same machine state.

The pair: a tiny random Qwen3-MoE (8 experts, top-2, expert intermediate size I) and a
Qwen3 whose MLP has 2 * I (what two experts compute per token), otherwise identical. Both
are saved with the tests' 384-token tokenizer, so the lm_head is small and the ratio is
the transformer layers'. Run from the repository root:

    PYTHONPATH=. python scripts/moe_bench.py [--out DIR] [--pairs 3] [-- extra bench args]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

COMMON = dict(vocab_size=384, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)


def build(out: Path, expert_size: int) -> tuple[Path, Path]:
    from tests._models import save_hf_model

    moe, dense = out / "qwen3-moe", out / "qwen3-dense"
    if not (moe / "config.json").exists():
        save_hf_model(moe, "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                      {**COMMON, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": expert_size,
                       "intermediate_size": 2 * expert_size, "norm_topk_prob": True, "decoder_sparse_step": 1})
    if not (dense / "config.json").exists():
        save_hf_model(dense, "Qwen3ForCausalLM", "Qwen3Config", {**COMMON, "intermediate_size": 2 * expert_size})
    return moe, dense


def bench(model: Path, args: argparse.Namespace, extra: list[str]) -> float:
    result = model.parent / f"{model.name}.json"
    cmd = [sys.executable, "-m", "pagedllm.cli", "bench", "throughput", "--model", str(model), "--dtype", "float32",
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--disable-tqdm", "--output-json", str(result), *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())["output_tokens_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".peers/moe-bench"))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--expert-size", type=int, default=512)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    moe, dense = build(args.out, args.expert_size)
    for i in range(args.pairs):
        moe_rate, dense_rate = bench(moe, args, extra), bench(dense, args, extra)
        print(f"pair {i + 1}: MoE {moe_rate:.0f} output tok/s, dense {dense_rate:.0f} -> MoE step time "
              f"{dense_rate / moe_rate:.2f}x dense", flush=True)


if __name__ == "__main__":
    main()
