"""Incremental detokenization and stop strings.

Text grows only by whole characters: a delta that ends in an incomplete UTF-8
sequence (decoded as U+FFFD) is held back until the next token completes it. A few
prompt tokens are decoded as context so that tokenizers which drop a leading space
at the start of a decode (SentencePiece) still give the first output token its space.
While streaming, the last len(longest stop string) - 1 characters are held back, so
a stop string is never half-emitted.
"""

from __future__ import annotations

from typing import Any

NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.hold_back = max((len(s) for s in stop), default=1) - 1 if not include_stop_str_in_output else 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string that matched (text truncated at it), else None."""
        for token_id in token_ids:
            self.ids.append(token_id)
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.ids[self.prefix_offset:])
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                continue
            delta = new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            matched = self._check_stop(len(delta))
            if matched is not None:
                return matched
        return None

    def _check_stop(self, num_new_chars: int) -> str | None:
        if not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        search_from = max(0, len(self.text) - num_new_chars - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def output_text(self, finished: bool) -> str:
        """The text safe to show now (all of it once the request finished)."""
        if finished or not self.hold_back:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]
