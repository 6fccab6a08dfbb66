"""Incremental detokenization and stop strings.

Text grows only by whole characters: a delta that ends in an incomplete UTF-8
sequence (decoded as U+FFFD) is held back until the next token completes it. A few
prompt tokens are decoded as context so that tokenizers which drop a leading space
at the start of a decode (SentencePiece) still give the first output token its space.
While streaming, the last len(longest stop string) - 1 characters are held back, so
a stop string is never half-emitted.

The stop check runs in the engine's step loop, shared by every request, so its cost per
step must not grow with the text generated so far, nor with stop strings that cannot
end in the new text: a stop string newly completed by a delta ends inside the delta, so
only the stop strings whose last character occurs in the delta are looked for, and only
in the delta plus the len(stop) - 1 characters before it. (An occurrence that ended
earlier would have stopped the request at an earlier step.) The server also caps the
number and length of stop strings (`pagedllm.server.protocol`).
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
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.hold_back = max((len(s) for s in stop), default=1) - 1 if not include_stop_str_in_output else 0
        # last character -> [(position in `stop`, stop string, its length)], in list order
        self._stops_ending_in: dict[str, list[tuple[int, str, int]]] = {}
        for i, s in enumerate(stop):
            self._stops_ending_in.setdefault(s[-1], []).append((i, s, len(s)))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string that matched (text truncated at it), else
        None. `num_used` says how many of `token_ids` were read: with several tokens in
        one step (speculative decoding), the ones after a stop string's are not."""
        self.num_used = 0
        for token_id in token_ids:
            self.num_used += 1
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
        """The stop string completed by the last `num_new_chars` characters, if any (the one
        that starts first; on a tie, the one listed first), truncating the text at it."""
        if not self._stops_ending_in:
            return None
        end = len(self.text)
        new_text = self.text[end - num_new_chars:]
        candidates = [entry for char in set(new_text) for entry in self._stops_ending_in.get(char, ())]
        best: tuple[int, int, str] | None = None  # (start, position in `stop`, stop string)
        for i, s, length in candidates:
            idx = self.text.find(s, max(0, end - num_new_chars - length + 1))
            if idx != -1 and (best is None or (idx, i) < best[:2]):
                best = (idx, i, s)
        if best is None:
            return None
        idx, _, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def output_text(self, finished: bool) -> str:
        """The text safe to show now (all of it once the request finished)."""
        if finished or not self.hold_back:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]
