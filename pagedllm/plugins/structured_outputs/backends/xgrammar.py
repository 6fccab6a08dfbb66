"""xgrammar (MLC, C++): a pushdown automaton whose token masks are mostly precomputed at
compile time (the "adaptive token mask cache"), so compiling costs more and each mask less.

Grammar kinds: JSON schema (xgrammar's converter; no `whitespace_pattern`: that is
refused, so "auto" moves on), regex, choice, grammar as GBNF / EBNF (`root ::= ...`,
llama.cpp's format, root rule `root`) or as Lark (`start: ...`, xgrammar's Lark front
end), and structural tags in xgrammar's own format (every `format` type it defines).

xgrammar's `strict_mode` is off: objects are closed for every backend alike before the
schema gets here (../spec.py), and one that says `"additionalProperties": true` is honoured.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

import xgrammar

from pagedllm.plugins.structured_outputs.backends import CompiledGrammar, GrammarBackend, Matcher, UnsupportedSpec
from pagedllm.plugins.structured_outputs.spec import CompileSpec

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[04:05:23] /project/cpp/x.cc:94: " before each message
_UNSUPPORTED_MARKERS = ("not supported", "Unsupported", "unsupported")


def _message(exc: BaseException) -> str:
    return _LOCATION.sub("", str(exc).strip()).strip()


class XGrammarMatcher(Matcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_accepting(self) -> bool:
        return self._m.is_completed()


class XGrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def new_matcher(self) -> Matcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(self._compiled))


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        try:
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                           stop_token_ids=list(eos_token_ids) or None)
        except ValueError as exc:
            raise UnsupportedSpec(f"the xgrammar backend cannot read this tokenizer: {exc}") from exc
        # our own LRU caches compiled grammars; xgrammar's cache would only hold them twice
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                                  cache_enabled=False)

    def compile(self, spec: CompileSpec) -> CompiledGrammar:
        self.check(spec)
        if spec.whitespace_pattern is not None and not spec.disable_any_whitespace:
            raise UnsupportedSpec("the xgrammar backend has no whitespace_pattern; backends that do: "
                                  "guidance, outlines")
        try:
            return XGrammarGrammar(self._compile(spec))
        except (RuntimeError, ValueError, TypeError) as exc:
            message = f"xgrammar: {_message(exc)}"
            if any(m in message for m in _UNSUPPORTED_MARKERS):
                raise UnsupportedSpec(message) from None
            raise ValueError(message) from None

    def _compile(self, spec: CompileSpec) -> Any:
        c = self._compiler
        if spec.kind in ("json", "json_object"):
            schema = spec.text if spec.kind == "json" else '{"type": "object"}'
            compact = spec.disable_any_whitespace
            return c.compile_json_schema(schema, any_whitespace=not compact, strict_mode=False,
                                         separators=(",", ":") if compact else None)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "choice":
            # an EBNF string literal takes JSON's escapes
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in spec.value()))
        if spec.kind == "grammar":
            return c.compile_grammar(spec.text) if "::=" in spec.text else c.compile_lark(spec.text)
        return c.compile_structural_tag(spec.text)
