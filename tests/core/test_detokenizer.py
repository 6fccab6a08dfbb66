"""Incremental detokenization: whole characters only, equal to a full decode at the end,
stop strings truncate and are never half-streamed."""

from __future__ import annotations

import pytest

from pagedllm.core.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello world! Paris is the capital.", "emoji 😀🎉 and café, naïve, 日本語", "  spaces\n\n\ttabs  "]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_matches_full_decode_and_is_never_broken(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [5, 6], skip_special_tokens=True, stop=[],
                                   include_stop_str_in_output=False)
    seen = []
    for token in ids:
        detok.add_tokens([token])
        seen.append(detok.output_text(False))
        assert "\ufffd" not in seen[-1], "a partial UTF-8 character was emitted"
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), "streamed text must only grow"
    assert detok.output_text(True) == tokenizer.decode(ids)


def test_stop_string_truncates_and_is_held_back(tokenizer):
    ids = tokenizer.encode("Hello world! Paris is the capital.")
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=["Paris"],
                                   include_stop_str_in_output=False)
    matched = None
    for token in ids:
        matched = detok.add_tokens([token])
        assert "Par" not in detok.output_text(False)
        if matched:
            break
    assert matched == "Paris"
    assert detok.output_text(True) == "Hello world! "


def test_include_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=["world"],
                                   include_stop_str_in_output=True)
    assert detok.add_tokens(tokenizer.encode("Hello world! Paris")) == "world"
    assert detok.output_text(True) == "Hello world"
