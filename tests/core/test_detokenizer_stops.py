"""The stop-string check: finds stops that span deltas, agrees with the plain windowed
search it replaced, and does per-step work only for stop strings that can end in the
new text (it runs in the engine loop every request shares)."""

from __future__ import annotations

import random
from typing import Any

from pagedllm.core.detokenizer import IncrementalDetokenizer


class PieceTokenizer:
    """Token i decodes to PIECES[i]; no byte fallback, so every token is a whole delta."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def windowed_search_reference(deltas: list[str], stop: list[str], include: bool) -> tuple[str | None, str]:
    """The stop check as it was before: after each delta, look for every stop string from
    len(text) - len(delta) - longest + 1 on; the earliest start wins, then list order."""
    text = ""
    longest = max((len(s) for s in stop), default=0)
    for delta in deltas:
        text += delta
        if not stop:
            continue
        search_from = max(0, len(text) - len(delta) - longest + 1)
        best: tuple[int, str] | None = None
        for s in stop:
            idx = text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            return s, text[: idx + len(s)] if include else text[:idx]
    return None, text


def run(pieces: list[str], token_batches: list[list[int]], stop: list[str],
        include: bool) -> tuple[str | None, str]:
    detok = IncrementalDetokenizer(PieceTokenizer(pieces), [], True, stop, include)
    for batch in token_batches:
        matched = detok.add_tokens(batch)
        if matched is not None:
            return matched, detok.output_text(True)
    return None, detok.output_text(True)


def test_stop_spanning_two_deltas_is_found() -> None:
    pieces = ["Hel", "lo wo", "rld", "!"]
    assert run(pieces, [[0], [1], [2], [3]], ["o wor"], False) == ("o wor", "Hell")
    assert run(pieces, [[0], [1], [2], [3]], ["lo wor"], True) == ("lo wor", "Hello wor")
    # a stop completed by the delta of a later step, spanning three deltas
    assert run(pieces, [[0], [1], [2], [3]], ["llo world"], False) == ("llo world", "He")
    # the earliest start wins over the stop listed first
    assert run(pieces, [[0, 1, 2]], ["world", "lo"], False) == ("lo", "Hel")


def test_matches_the_windowed_search_on_random_cases() -> None:
    rng = random.Random(1234)
    alphabet = "abc d"
    for case in range(600):
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(12)]
        tokens = [rng.randrange(len(pieces)) for _ in range(rng.randint(1, 30))]
        batches, i = [], 0
        while i < len(tokens):
            size = rng.randint(1, 3)
            batches.append(tokens[i:i + size])
            i += size
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 5))]
        include = rng.random() < 0.5
        deltas = [pieces[t] for t in tokens]
        expected = windowed_search_reference(deltas, stop, include)
        # several tokens per add_tokens call: each is still checked as its own delta
        assert run(pieces, batches, stop, include) == expected, (case, pieces, tokens, stop, include)


class CountingStr(str):
    """A stop string that counts how often its length is asked for."""

    calls = 0

    def __len__(self) -> int:
        CountingStr.calls += 1
        return super().__len__()


def test_per_step_work_skips_stop_strings_that_cannot_end_in_the_delta() -> None:
    # 5000 stop strings ending in "x"; the text never contains an "x"
    stop: list[Any] = [CountingStr(f"stop{i}x") for i in range(5000)]
    detok = IncrementalDetokenizer(PieceTokenizer(["ab", "cd "]), [], True, stop, False)
    CountingStr.calls = 0
    for step in range(200):
        assert detok.add_tokens([step % 2]) is None
    assert CountingStr.calls == 0, "the check looked at stop strings that cannot end in the new text"
    assert detok.output_text(True) == "abcd " * 100
