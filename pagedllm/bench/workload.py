"""The prompts a benchmark sends: random token ids with a fixed seed, or a JSONL dataset.

Every engine in a comparison must see exactly the same token ids, so prompts are
built once, as token id lists, by this module and handed to each engine as ids
(never re-tokenized per engine).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable


@dataclass
class BenchRequest:
    """One prompt and how many tokens to generate for it."""

    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    seed: int = 0, exclude: Iterable[int] = ()) -> list[BenchRequest]:
    """`num_prompts` prompts of exactly `input_len` ids drawn uniformly from the vocabulary.

    Special tokens (`exclude`, e.g. BOS/EOS) are left out so no prompt ends early or
    confuses a chat template; the seed makes runs (and engines) comparable.
    """
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"num_prompts, input_len and output_len must be >= 1, "
                         f"got {num_prompts}, {input_len}, {output_len}")
    banned = set(exclude)
    allowed = [t for t in range(vocab_size) if t not in banned]
    if not allowed:
        raise ValueError(f"no usable token ids in a vocabulary of {vocab_size}")
    rng = random.Random(seed)
    return [BenchRequest([rng.choice(allowed) for _ in range(input_len)], output_len)
            for _ in range(num_prompts)]


def load_dataset(path: str | Path, num_prompts: int, output_len: int, tokenizer: Any = None) -> list[BenchRequest]:
    """Read up to `num_prompts` requests from a JSONL file.

    Each line is an object with "prompt_token_ids" (used as is), "messages" (a chat, through
    the tokenizer's chat template) or "prompt" (encoded with `tokenizer`, which is then
    required for both); an optional "output_len" overrides
    `output_len` for that line. Errors name the file and line, since datasets are
    usually hand-made.
    """
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(requests) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
            n_out = int(item.get("output_len", output_len))
            if "prompt_token_ids" in item:
                ids = [int(t) for t in item["prompt_token_ids"]]
                requests.append(BenchRequest(ids, n_out, item.get("prompt")))
            elif "messages" in item:  # a chat: the model's chat template makes the prompt
                if tokenizer is None:
                    raise ValueError(f"{path}:{lineno}: a chat needs a tokenizer")
                ids = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
                requests.append(BenchRequest(list(ids), n_out))
            elif "prompt" in item:
                if tokenizer is None:
                    raise ValueError(f"{path}:{lineno}: a text prompt needs a tokenizer")
                requests.append(BenchRequest(list(tokenizer.encode(item["prompt"])), n_out, item["prompt"]))
            else:
                raise ValueError(f"{path}:{lineno}: needs a 'prompt', 'messages' or 'prompt_token_ids' field")
    if not requests:
        raise ValueError(f"{path}: no requests found")
    return requests


def special_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's special token ids (BOS, EOS, PAD, ...), or none if it has no such notion."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
    return sorted(ids)


def vocab_size_of(tokenizer: Any, fallback: int | None = None) -> int:
    """How many ids a prompt may draw from: the smaller of tokenizer and model vocabularies
    (a model's embedding is often padded past the tokenizer's last id)."""
    sizes = [s for s in (len(tokenizer) if tokenizer is not None else None, fallback) if s]
    if not sizes:
        raise ValueError("cannot tell the vocabulary size: no tokenizer and no model vocab_size")
    return min(sizes)


def build_requests(args: Any, tokenizer: Any, model_vocab_size: int | None = None) -> list[BenchRequest]:
    """The requests for a CLI invocation: `--dataset` if given, else random ids."""
    if getattr(args, "dataset", None):
        return load_dataset(args.dataset, args.num_prompts, args.output_len, tokenizer)
    return random_requests(args.num_prompts, args.input_len, args.output_len,
                           vocab_size_of(tokenizer, model_vocab_size), getattr(args, "seed", 0),
                           special_ids(tokenizer) if tokenizer is not None else ())
