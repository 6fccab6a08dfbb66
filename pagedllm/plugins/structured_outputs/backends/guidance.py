"""llguidance (Microsoft's guidance engine, Rust): a lazy Earley parser over a derivative-
based lexer, so compiling is nearly free and each mask is computed when asked.

Grammar kinds: JSON schema (its own converter, with `whitespace_pattern`), regex (Rust
`regex` syntax), choice, grammar as Lark (llguidance's dialect: terminals in /regex/,
`%json {...}` inside rules) or as GBNF / EBNF (`root ::= ...`, llama.cpp's format,
converted to Lark by llguidance's `any_to_lark`), and structural tags of the
`triggered_tags` shape whose tags hold JSON schemas (llguidance's `StructTag`); other
structural-tag formats are xgrammar's.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Sequence

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from pagedllm.plugins.structured_outputs.backends import (
    CompiledGrammar,
    GrammarBackend,
    Matcher,
    UnsupportedSpec,
    row_pointer,
)
from pagedllm.plugins.structured_outputs.spec import CompileSpec

_UNSUPPORTED_MARKERS = ("Unimplemented keys", "not supported", "Unsupported")


class GuidanceMatcher(Matcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask, row: int) -> None:
        ptr, words = row_pointer(bitmask, row)
        self._m.unsafe_compute_mask_ptr(ptr, words * 4)

    def accept(self, token_id: int) -> bool:
        # try_consume_tokens leaves the matcher as it was on a refused token (consume_token
        # would put it in its error state for good)
        return self._m.try_consume_tokens([token_id]) == 1

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self._m.get_error()}")

    def is_accepting(self) -> bool:
        return self._m.is_accepting()


class GuidanceGrammar(CompiledGrammar):
    def __init__(self, template: Any) -> None:
        self._template = template

    def new_matcher(self) -> Matcher:
        return GuidanceMatcher(self._template.deep_copy())


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise UnsupportedSpec(f"the guidance backend needs a fast (tokenizers) tokenizer; got "
                                  f"{type(tokenizer).__name__}")
        backend = copy.copy(backend)  # no padding or truncation in what llguidance reads
        backend.no_padding()
        backend.no_truncation()
        self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                 eos_token=list(eos_token_ids) or None)

    def compile(self, spec: CompileSpec) -> CompiledGrammar:
        self.check(spec)
        grammar = self._grammar(spec)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            error = matcher.get_error()
            if any(m in error for m in _UNSUPPORTED_MARKERS):
                raise UnsupportedSpec(f"llguidance: {error}")
            raise ValueError(f"llguidance: {error}")
        return GuidanceGrammar(matcher)

    def _grammar(self, spec: CompileSpec) -> str:
        if spec.kind in ("json", "json_object"):
            options: dict[str, Any] = {}
            if spec.disable_any_whitespace:
                options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
            elif spec.whitespace_pattern is not None:
                options = {"whitespace_pattern": spec.whitespace_pattern}
            schema = spec.text if spec.kind == "json" else '{"type": "object"}'
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options or None)
            except ValueError as exc:
                raise ValueError(f"llguidance: {exc}") from None
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            # a Lark string literal takes JSON's escapes
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec.value()))
        if spec.kind == "grammar":
            try:
                lark = any_to_lark(spec.text)
            except Exception as exc:  # the converter raises whatever its parser hits
                raise ValueError(f"llguidance: not a Lark or GBNF grammar: {exc}") from None
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return self._structural_tag(spec.value()["format"])

    def _structural_tag(self, fmt: dict) -> str:
        """llguidance's StructTag covers xgrammar's `triggered_tags` whose tags are
        `begin <JSON> end` with string ends, any text around them, any number of tags."""
        hint = "; the xgrammar backend supports every structural-tag format"
        if fmt.get("type") != "triggered_tags" or fmt.get("at_least_one") or fmt.get("stop_after_first") \
                or fmt.get("excludes"):
            raise UnsupportedSpec(f"the guidance backend supports only plain triggered_tags structural tags{hint}")
        triggers, tags = fmt.get("triggers") or [], []
        for tag in fmt.get("tags") or []:
            content = tag.get("content") or {}
            begin, end = tag.get("begin"), tag.get("end")
            if content.get("type") != "json_schema" or content.get("style", "json") != "json" \
                    or not isinstance(begin, str) or not isinstance(end, str):
                raise UnsupportedSpec(f"the guidance backend supports only JSON-schema tags with string "
                                      f"begin and end{hint}")
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise ValueError(f"structural_tag begin {begin!r} starts with none of the triggers {triggers}")
            tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=content["json_schema"], end=end))
        if not tags:
            raise ValueError("structural_tag has no tags")
        special = set(self.tokenizer.get_added_vocab()) if hasattr(self.tokenizer, "get_added_vocab") else set()
        # a trigger spelled <...> is matched as one special token only where it is one
        return llguidance.StructTag.to_grammar(tags, assume_special=all(t in special for t in triggers))
