"""The tokenizer built from SmolLM2's GGUF metadata against transformers' own GGUF tokenizer.

One deliberate difference: SmolLM2 splits every digit off before GPT-2's regex (its
tokenizer.json has Digits(individual_digits) + ByteLevel; llama.cpp's "smollm"
pre-tokenizer does the same). transformers' GGUF loader does not know "smollm" and uses
plain GPT-2 splitting, which differs only when two or more whitespace characters precede
a digit. Those strings are compared against transformers' vocabulary with the digit split
restored; every other string must match transformers exactly.
"""

from __future__ import annotations

import os
import random
import re

import pytest
from tokenizers import Tokenizer, pre_tokenizers

from pagedllm.core.detokenizer import IncrementalDetokenizer
from pagedllm.plugins.quant.gguf_file import GGUFFile
from pagedllm.plugins.quant.gguf_tokenizer import build_tokenizer

DIGIT_RULE_DIFFERS = re.compile(r"\s\s\d")
FIXED = [
    "", "hello", "Hello, world!", "hello 12345 world", "3.14159 and 2,718", "  x  y\n\n\tz",
    "   leading spaces", "trailing spaces   ", "\r\n\r\n", "a\u00a0b", "tab\tseparated\tvalues",
    "Ünïcödé naïve résumé façade", "日本語のテキスト", "中文字符测试", "한국어 문장", "Ελληνικά", "русский текст",
    "🎉🚀😀", "👩‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "mixed 🎉 emoji 🎉🎉 runs",
    "def add(a, b):\n    return a + b  # sum\n", "if (x <= 10 && y != 0) { z += x / y; }",
    "<|im_start|>user\nhi<|im_end|>\n", "x<|endoftext|>y", "<|im_start|><|im_end|>", "<think>",
    "I'm you're they'll we've he'd it's", "HTTP/1.1 200 OK\r\nContent-Length: 42", "$100,000.00 (USD)",
    "     ", "\n", " ", "a" * 300, "The quick brown fox jumps over the lazy dog. " * 5,
]
ALPHABET = (list("abcXYZ0123456789 \n\t.,;:!?'\"()[]{}<>|_-+=*/\\@#$%^&~`")
            + list("éüñß中文日本한국어ΩπЖ🎉😀🚀\u200d\u00a0")
            + ["  ", "\n\n", " the", "ing", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s"])


def _random_strings(count: int) -> list[str]:
    rng = random.Random(1234)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(count)]


STRINGS = FIXED + _random_strings(300)


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return build_tokenizer(GGUFFile(smollm2_path).metadata, smollm2_path)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


@pytest.fixture(scope="module")
def reference_digit_split(reference):
    """transformers' vocabulary, merges and added tokens with SmolLM2's digit split."""
    tok = Tokenizer.from_str(reference.backend_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return tok


@pytest.mark.slow
def test_encode_matches_transformers(ours, reference, reference_digit_split) -> None:
    num_exact = 0
    for text in STRINGS:
        ids = ours.encode(text)
        assert ids == reference_digit_split.encode(text).ids, text
        if not DIGIT_RULE_DIFFERS.search(text):
            assert ids == reference.encode(text), text
            num_exact += 1
    assert num_exact > 200  # most strings are compared with transformers itself


@pytest.mark.slow
def test_digit_split_follows_smollm2_not_transformers(ours, reference) -> None:
    text = "x  42"
    assert ours.convert_ids_to_tokens(ours.encode(text)) == ["x", "ĠĠ", "4", "2"]
    assert reference.convert_ids_to_tokens(reference.encode(text)) == ["x", "Ġ", "Ġ", "4", "2"]


@pytest.mark.slow
def test_decode_matches_transformers_and_round_trips(ours, reference) -> None:
    for text in STRINGS:
        ids = reference.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.slow
def test_special_tokens_vocab_and_chat_template(ours, reference) -> None:
    assert len(ours) == len(reference) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert (ours.bos_token, ours.eos_token) == (reference.bos_token, reference.eos_token)
    assert ours.all_special_tokens == reference.all_special_tokens
    ids = list(range(0, 49152, 97))
    assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    for conversation in (chat, chat[1:2]):
        ours_ids = ours.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        ref_ids = reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        assert list(ours_ids["input_ids"]) == list(ref_ids["input_ids"])
    text = ours.apply_chat_template(chat[1:2], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n")


def test_partial_utf8_decodes_to_replacement_char(ours) -> None:
    """The engine's incremental detokenizer holds back text ending in U+FFFD until the
    next token completes the character; byte-level pieces of one emoji must show that."""
    ids = ours.encode(" 🎉")
    assert len(ids) > 1
    assert ours.decode(ids[:-1]).endswith("\ufffd")
    assert ours.decode(ids) == " 🎉"


@pytest.mark.parametrize("text", ["Hello 🎉 wörld, 日本語!", "line one\n  line two 42\n", "👩‍👩‍👧‍👦 family"])
def test_incremental_detokenization_equals_full_decode(ours, text) -> None:
    prompt = ours.encode("<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(ours, prompt, skip_special_tokens=True, stop=[],
                                   include_stop_str_in_output=False)
    ids = ours.encode(text)
    for token_id in ids:
        detok.add_tokens([token_id])
    assert detok.output_text(finished=True) == ours.decode(ids) == text


def test_unsupported_tokenizer_model_is_named(smollm2_path) -> None:
    meta = dict(GGUFFile(smollm2_path).metadata, **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(NotImplementedError, match=r"tokenizer model 'llama' is not supported.*gpt2"):
        build_tokenizer(meta, smollm2_path)


def test_unknown_pre_tokenizer_is_named(smollm2_path) -> None:
    meta = dict(GGUFFile(smollm2_path).metadata, **{"tokenizer.ggml.pre": "martian"})
    with pytest.raises(NotImplementedError, match=r"pre-tokenizer 'martian'.*supported: .*smollm"):
        build_tokenizer(meta, smollm2_path)
