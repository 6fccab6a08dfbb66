"""Write the two single-stream workloads the speculative-decoding tables in README.md use,
as `pagedllm bench --dataset` JSONL files (chats, 192 output tokens each):

- grounded.jsonl: 8 chats asking the model to rewrite one of this repository's own source
  files (its first ~48 lines), so the answer repeats much of the prompt (what n-gram and
  suffix drafts exploit);
- free.jsonl: 8 chats asking for short stories, where little of the answer is in the prompt.

    python scripts/spec_workloads.py OUT_DIR
    pagedllm bench throughput --dataset OUT_DIR/grounded.jsonl --num-prompts 8 --max-num-seqs 1 \\
        --output-len 192 [--speculative-config '{"method": "ngram", ...}']
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ["pagedllm/core/block_manager.py", "pagedllm/core/request.py", "pagedllm/core/detokenizer.py",
         "pagedllm/core/precision.py", "pagedllm/ops/cpu/crossover.py", "pagedllm/bench/workload.py",
         "pagedllm/core/cpu_threads.py", "pagedllm/server/limits.py"]
STORIES = ["a lighthouse keeper who finds a message in a bottle", "a robot learning to bake bread",
           "two rival chess players stuck in a snowed-in train", "a girl who can hear the thoughts of trees",
           "the last bookshop on Mars", "a detective who is afraid of the dark",
           "a village where it rains only on Tuesdays", "an old dog's final adventure"]
OUTPUT_LEN = 192


def _chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "output_len": OUTPUT_LEN}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    grounded = []
    for name in FILES:
        code = "\n".join((ROOT / name).read_text().splitlines()[:48])
        grounded.append(_chat("Rewrite this Python code with the same behaviour, adding type hints where they "
                              f"are missing. Reply with the whole code only.\n\n```python\n{code}\n```"))
    free = [_chat(f"Write a short story about {topic}.") for topic in STORIES]
    for file, rows in (("grounded.jsonl", grounded), ("free.jsonl", free)):
        (out / file).write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(out / file)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
