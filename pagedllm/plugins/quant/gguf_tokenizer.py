"""The tokenizer a GGUF file describes, built directly with the `tokenizers` library.

A GGUF carries no tokenizer.json, only llama.cpp's metadata: the vocabulary
(`tokenizer.ggml.tokens`), merges, token types (3 = control, 4 = user-defined), the
special ids, the pre-tokenizer name (`tokenizer.ggml.pre`) and the chat template. We
assemble a byte-level BPE from those and wrap it in transformers'
`PreTrainedTokenizerFast`, so callers get the usual interface. Building it this way
takes a fraction of a second; transformers' own GGUF path re-derives it through a slow
tokenizer class. Only byte-level BPE ("gpt2") vocabularies are supported today.
"""

from __future__ import annotations

import functools
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL, USER_DEFINED = 3, 4
SUPPORTED_TOKENIZERS = ("gpt2",)

# llama.cpp pre-tokenizer names -> split regex applied before the byte-level mapping.
# None means GPT-2's own regex (ByteLevel(use_regex=True)).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_REGEXES: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None,
    "llama3": _LLAMA3, "llama-bpe": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}
# These split off every digit first, then apply GPT-2's regex (llama.cpp's llama-vocab.cpp
# groups them; SmolLM2's own tokenizer.json says Digits(individual) + ByteLevel).
DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand
    for themselves, the other 68 bytes are moved to code points 256 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _spelled(token: str, alphabet: frozenset[str]) -> str:
    """A vocabulary entry in the byte alphabet (llama.cpp stores a few, e.g. added ones, raw)."""
    if set(token) <= alphabet:
        return token
    table = byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str | None, path: str) -> pre_tokenizers.PreTokenizer:
    name = pre or "default"
    if name in DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if name not in SPLIT_REGEXES:
        raise NotImplementedError(
            f"{path}: GGUF pre-tokenizer {name!r} is not supported yet (supported: "
            f"{', '.join(sorted([*SPLIT_REGEXES, *DIGIT_SPLIT_PRE]))})")
    regex = SPLIT_REGEXES[name]
    if regex is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_backend(meta: dict[str, Any], path: str) -> Tokenizer:
    """The `tokenizers.Tokenizer` for a byte-level BPE vocabulary in GGUF metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZERS:
        raise NotImplementedError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported yet (supported: "
            f"{', '.join(SUPPORTED_TOKENIZERS)}); pass --tokenizer with a Hugging Face tokenizer directory")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    alphabet = frozenset(byte_alphabet().values())
    vocab = {_spelled(tok, alphabet): i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), path)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        # A "control" token outside the byte alphabet is a llama.cpp mislabel; adding it
        # would grow the vocabulary past the embedding, so it is left out.
        special = [AddedToken(t, special=True, normalized=False)
                   for t, kind_ in zip(tokens, types.tolist()) if kind_ == CONTROL and set(t) <= alphabet]
        tok.add_special_tokens(special)
        user = [AddedToken(t, special=False, normalized=False)
                for t, kind_ in zip(tokens, types.tolist()) if kind_ == USER_DEFINED and t in vocab]
        tok.add_tokens(user)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))])
    return tok


def build_tokenizer(meta: dict[str, Any], path: str) -> Any:
    """A transformers `PreTrainedTokenizerFast` with the file's special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokenizer.ggml.tokens"]

    def special(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return None if token_id is None or int(token_id) >= len(tokens) else tokens[int(token_id)]

    return PreTrainedTokenizerFast(
        tokenizer_object=build_backend(meta, path),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=special("bos_token_id"), eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"),
        clean_up_tokenization_spaces=False,
    )
