"""Prompts: random ids are reproducible and avoid special tokens; datasets are checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.bench.workload import load_dataset, random_requests


def test_random_requests_are_seeded_and_sized() -> None:
    a = random_requests(3, 7, 5, vocab_size=50, seed=1, exclude=[0, 1, 2])
    b = random_requests(3, 7, 5, vocab_size=50, seed=1, exclude=[0, 1, 2])
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(r.prompt_len == 7 and r.output_len == 5 for r in a)
    assert all(3 <= t < 50 for r in a for t in r.prompt_token_ids)
    assert [r.prompt_token_ids for r in random_requests(3, 7, 5, 50, seed=2)] != [r.prompt_token_ids for r in a]


def test_random_requests_reject_bad_sizes() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        random_requests(0, 8, 8, 100)


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_dataset_reads_ids_and_text(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([json.dumps({"prompt_token_ids": [5, 6, 7]}),
                               "",
                               json.dumps({"prompt": "hi", "output_len": 3}),
                               json.dumps({"prompt_token_ids": [1]})]))
    reqs = load_dataset(path, num_prompts=2, output_len=9, tokenizer=_Tok())
    assert [(r.prompt_token_ids, r.output_len) for r in reqs] == [([5, 6, 7], 9), ([104, 105], 3)]


@pytest.mark.parametrize("line, message", [("{not json", "not valid JSON"), ('{"text": "x"}', "needs a 'prompt'"),
                                           ('{"prompt": "x"}', "needs a tokenizer")])
def test_dataset_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_dataset(path, 4, 8)
    assert f"{path}:1" in str(info.value)
