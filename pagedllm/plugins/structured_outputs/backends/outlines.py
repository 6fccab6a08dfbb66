"""outlines-core (Rust): a regular language only. A JSON schema becomes a regex
(`json_schema.build_regex_from_schema`), the regex a token-level DFA (`Index`) built
ahead of time over the whole vocabulary, and each mask a table lookup (`Guide`).

Grammar kinds: JSON schema, json_object (objects nested to a fixed depth: a regex cannot
nest without bound), regex (Rust `regex-automata` syntax: no look-around, no
back-references) and choice. Context-free grammars and structural tags are refused with
the backends that have them. Schema keywords the regex builder would silently drop
(number bounds, uniqueItems, property counts, ...) are refused too, since the output could
then break the schema. Extra properties (`"additionalProperties": true`) are not
generated: the output is still valid, only narrower.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import outlines_core

from pagedllm.plugins.structured_outputs.backends import (
    CompiledGrammar,
    GrammarBackend,
    Matcher,
    UnsupportedSpec,
    row_pointer,
)
from pagedllm.plugins.structured_outputs.spec import CompileSpec

MAX_ROLLBACK = 1024  # states a Guide keeps to undo (drafts are rolled back a few at a time)

# keywords outlines-core's regex builder ignores although they constrain the value
IGNORED_KEYWORDS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
    "minProperties", "maxProperties", "contains", "minContains", "maxContains", "patternProperties",
    "propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "if", "then", "else",
    "unevaluatedItems", "unevaluatedProperties",
})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "additionalItems")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_REGEX_META = frozenset("\\.^$|?*+()[]{}-&~#")
_REGEX_CONTROL = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\f": "\\f", "\v": "\\v"}


def ignored_keywords(schema: Any) -> list[str]:
    """The keywords in `schema` (any depth, schema positions only: not inside enum, const
    or property names) that outlines-core would ignore."""
    found: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        found.extend(k for k in node if k in IGNORED_KEYWORDS)
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        stack.extend(node[key] for key in _SCHEMA_ONE if key in node)
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
    return sorted(set(found))


def escape_regex(text: str) -> str:
    """`text` as a literal in Rust regex syntax (which, unlike Python's, refuses escapes
    of letters and digits, so only punctuation is escaped, and control characters spelled)."""
    return "".join("\\" + c if c in _REGEX_META else _REGEX_CONTROL.get(c, c) for c in text)


def token_bytes(tokenizer: Any, vocab_size: int) -> dict[int, bytes]:
    """The bytes each ordinary token stands for (special tokens left out: a constraint never
    allows them). Byte-level BPE (GPT-2's printable alphabet) and SentencePiece spellings
    (the ▁ word mark, <0xHH> byte tokens) are decoded; anything else is taken as UTF-8."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(token_id)
    byte_level = _is_byte_level(tokenizer)
    inverse = _byte_level_decoder() if byte_level else {}
    out: dict[int, bytes] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special or token_id >= vocab_size:
            continue
        if byte_level and all(c in inverse for c in token):
            out[token_id] = bytes(inverse[c] for c in token)
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out[token_id] = bytes([int(token[3:5], 16)])
        else:
            out[token_id] = token.replace("\u2581", " ").encode("utf-8")
    return out


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable Latin-1 bytes spell themselves,
    the other 68 bytes (controls, space, ...) are spelled from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled = {chr(b): b for b in printable}
    moved = [b for b in range(256) if b not in printable]
    spelled.update({chr(0x100 + i): b for i, b in enumerate(moved)})
    return spelled


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders") or [decoder]
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


class OutlinesMatcher(Matcher):
    def __init__(self, index: Any) -> None:
        self._index = index
        self._guide = outlines_core.Guide(index, max_rollback=MAX_ROLLBACK)

    def fill_bitmask(self, bitmask, row: int) -> None:
        ptr, words = row_pointer(bitmask, row)
        self._guide.write_mask_into(ptr, words, 4)

    def accept(self, token_id: int) -> bool:
        if not self._guide.accepts_tokens([token_id]):
            return False
        self._guide.advance(token_id, return_tokens=False)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._guide.rollback_state(num_tokens)

    def is_accepting(self) -> bool:
        return self._index.is_final_state(self._guide.get_state())


class OutlinesGrammar(CompiledGrammar):
    def __init__(self, index: Any) -> None:
        self._index = index

    def new_matcher(self) -> Matcher:
        return OutlinesMatcher(self._index)


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        if not eos_token_ids:
            raise UnsupportedSpec("the outlines backend needs an end-of-sequence token")
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in token_bytes(tokenizer, vocab_size).items():
            if token_id not in eos_token_ids:
                by_bytes.setdefault(data, []).append(token_id)
        self._vocabulary = outlines_core.Vocabulary(eos_token_ids[0], by_bytes)

    def compile(self, spec: CompileSpec) -> CompiledGrammar:
        self.check(spec)
        regex = self._regex(spec)
        try:
            return OutlinesGrammar(outlines_core.Index(regex, self._vocabulary))
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"outlines: {exc}") from None

    def _regex(self, spec: CompileSpec) -> str:
        if spec.kind == "regex":
            return spec.text
        if spec.kind == "choice":
            return "(" + "|".join(escape_regex(c) for c in spec.value()) + ")"
        schema = spec.value() if spec.kind == "json" else {"type": "object"}
        ignored = ignored_keywords(schema)
        if ignored:
            raise UnsupportedSpec(f"the outlines backend would ignore the schema keywords {ignored}; "
                                  "backends that honour them: guidance, xgrammar")
        whitespace = "" if spec.disable_any_whitespace else spec.whitespace_pattern
        try:
            return outlines_core.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=whitespace)
        except (ValueError, RuntimeError) as exc:
            message = f"outlines: {str(exc).strip()}"
            if "not supported" in message or "Unsupported" in message:
                raise UnsupportedSpec(message) from None
            raise ValueError(message) from None
