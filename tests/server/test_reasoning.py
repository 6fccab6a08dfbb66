"""The deepseek_r1 reasoning parser: whole outputs and streamed deltas."""

from __future__ import annotations

import pytest

from pagedllm.server.reasoning import DeepSeekR1ReasoningParser, ReasoningDelta, get_reasoning_parser

CASES = [
    # (model output, reasoning, content)
    ("<think>Let me see.</think>The answer is 4.", "Let me see.", "The answer is 4."),
    ("Let me see.</think>The answer is 4.", "Let me see.", "The answer is 4."),  # R1: template opened <think>
    ("<think>still thinking", "still thinking", ""),
    ("no tags at all", "no tags at all", ""),
    ("\n<think>a</think>\n\nb", "a", "\n\nb"),
    ("<think></think>only content", "", "only content"),
]


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_split_whole_output(text: str, reasoning: str, content: str) -> None:
    assert DeepSeekR1ReasoningParser().split(text, finished=True) == (reasoning, content)


@pytest.mark.parametrize("text,reasoning,content", CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_streamed_deltas_add_up_whatever_the_chunking(text: str, reasoning: str, content: str, step: int) -> None:
    """Tags cut anywhere ("</th" + "ink>") never leak into either part."""
    tracker = ReasoningDelta(DeepSeekR1ReasoningParser())
    got_reasoning, got_content = "", ""
    cuts = list(range(step, len(text), step)) + [len(text)]
    for end in cuts:
        r, c = tracker.update(text[:end], finished=end == len(text))
        assert "<think>" not in r + c and "</think>" not in r + c
        got_reasoning += r
        got_content += c
    assert (got_reasoning, got_content) == (reasoning, content)


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("qwen9")
