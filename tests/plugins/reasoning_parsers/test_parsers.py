"""The built-in reasoning parsers: whole texts, and streams cut anywhere."""

from __future__ import annotations

import pytest

from pagedllm.core.contracts.reasoning import ReasoningDelta, ReasoningParser, partial_suffix
from pagedllm.plugins.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from pagedllm.plugins.reasoning_parsers.granite import GraniteReasoningParser
from pagedllm.plugins.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from tests.plugins.reasoning_parsers._stream import stream

STEPS = [1, 2, 3, 7]

# (model output, reasoning, content): for each, a stream of it ends where the whole text does.
DEEPSEEK = [
    ("<think>Let me see.</think>The answer is 4.", "Let me see.", "The answer is 4."),
    ("Let me see.</think>The answer is 4.", "Let me see.", "The answer is 4."),
    ("<think>still thinking", "still thinking", ""),
    ("no tags at all", "no tags at all", ""),
    ("\n<think>a</think>\n\nb", "a", "\n\nb"),
    ("a </th b</think>c", "a </th b", "c"),
    ("<think>x</think", "x</think", ""),
]
QWEN3 = [
    ("<think>Let me see.</think>The answer is 4.", "Let me see.", "The answer is 4."),
    ("  <think>\nhm\n</think>\n\n4", "\nhm\n", "\n\n4"),
    ("<think>unclosed", "unclosed", ""),
    ("The answer is 4.", "", "The answer is 4."),
    ("\n\nplain", "", "\n\nplain"),
    ("</think>only content", "", "only content"),
    ("<thinker> is a word", "", "<thinker> is a word"),
    ("ends with </thi", "", "ends with </thi"),
]
GRANITE = [
    ("Here is my thought process:\nAdd.\nHere is my response:\n4", "\nAdd.\n", "\n4"),
    ("Here's my thought process: a Here's my response: b", " a ", " b"),
    ("Here is my thought process: mixed Here's my response: b", " mixed ", " b"),
    ("Here is my thought process: never answered", " never answered", ""),
    ("Just the answer: 4", "", "Just the answer: 4"),
    ("Here is a list:", "", "Here is a list:"),
    ("Here is my thought process: x Here is my resp", " x Here is my resp", ""),
]
CASES = ([(DeepSeekR1ReasoningParser, *c) for c in DEEPSEEK] + [(Qwen3ReasoningParser, *c) for c in QWEN3]
         + [(GraniteReasoningParser, *c) for c in GRANITE])
IDS = [f"{cls.name}-{i}" for i, (cls, *_rest) in enumerate(CASES)]


@pytest.mark.parametrize("cls,text,reasoning,content", CASES, ids=IDS)
def test_whole_text(cls: type[ReasoningParser], text: str, reasoning: str, content: str) -> None:
    assert cls(None).split(text, finished=True) == (reasoning, content)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("cls,text,reasoning,content", CASES, ids=IDS)
def test_stream_only_grows_and_ends_as_the_whole_text(cls: type[ReasoningParser], text: str, reasoning: str,
                                                      content: str, step: int) -> None:
    assert stream(cls(None), text, step) == (reasoning, content)


@pytest.mark.parametrize("cls", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GraniteReasoningParser])
def test_no_marker_leaks_while_streaming(cls: type[ReasoningParser]) -> None:
    """Cut inside a marker, an unfinished stream shows no piece of it in either part."""
    opened = {"granite": "Here is my thought process: a Here is my response: b"}.get(cls.name, "<think>a</think>b")
    marker = cls.end_tag
    assert marker is not None
    cut = opened.index(marker) + 3
    reasoning, content = cls(None).split(opened[:cut], finished=False)
    assert (reasoning, content) == (" a " if cls.name == "granite" else "a", "")


def test_reasoning_delta_sends_each_part_once() -> None:
    tracker = ReasoningDelta(Qwen3ReasoningParser(None))
    text = "<think>ab</think>cd"
    sent = [tracker.update(text[:end], finished=end == len(text)) for end in range(1, len(text) + 1)]
    assert "".join(r for r, _ in sent) == "ab" and "".join(c for _, c in sent) == "cd"


def test_qwen3_whole_answer_splits_where_the_prompt_opened_the_block() -> None:
    assert Qwen3ReasoningParser(None).split("I think.</think>Yes.", finished=True) == ("I think.", "Yes.")


def test_qwen3_stream_cannot_relabel_content_already_sent() -> None:
    """The documented limit: without a leading <think>, text streamed before a late
    </think> was content, and stays content (the tag included), so the stream stays
    consistent with what the client has already shown."""
    text = "I think.</think>Yes."
    assert stream(Qwen3ReasoningParser(None), text, 1) == ("", text)


def test_qwen3_stream_labels_a_late_tag_when_nothing_was_sent_yet() -> None:
    parser = Qwen3ReasoningParser(None)
    assert parser.split("hm</think>", finished=False) == ("hm", "")
    assert parser.split("hm</think>ok", finished=True) == ("hm", "ok")


def test_a_fresh_qwen3_parser_per_choice_keeps_choices_apart() -> None:
    first, second = Qwen3ReasoningParser(None), Qwen3ReasoningParser(None)
    first.split("a", finished=False)
    assert second.split("a</think>b", finished=True) == ("a", "b")
    assert first.split("a</think>b", finished=True) == ("", "a</think>b")


@pytest.mark.parametrize("text,tags,expected", [
    ("abc</th", ("</think>",), 4),
    ("abc", ("</think>",), 0),
    ("x Here", ("Here is my response:", "Here's my response:"), 4),
    ("x Here'", ("Here is my response:", "Here's my response:"), 5),
    ("</think>", ("</think>",), 0),  # a whole tag is not a partial one
])
def test_partial_suffix(text: str, tags: tuple[str, ...], expected: int) -> None:
    assert partial_suffix(text, *tags) == expected
