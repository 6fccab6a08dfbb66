"""The deepseek_r1 reasoning parser through the server's names: whole outputs and streamed deltas."""

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


def test_the_server_names_are_the_plugins_classes() -> None:
    """The server's re-export is the registry's built-in, so older imports keep working."""
    from pagedllm.plugins.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser as plugin_class

    assert DeepSeekR1ReasoningParser is plugin_class
    assert type(get_reasoning_parser("deepseek_r1")) is plugin_class


def test_each_chat_choice_gets_its_own_parser() -> None:
    """Parsers may keep state (qwen3 remembers content it has sent), so the server builds
    one per choice from `--reasoning-parser`'s class, with the model's tokenizer."""
    from types import SimpleNamespace

    from pagedllm.server.chat import _choice_text

    tokenizer = object()
    state = SimpleNamespace(reasoning=get_reasoning_parser("qwen3").__class__,
                            llm_engine=SimpleNamespace(tokenizer=tokenizer))
    first, second = _choice_text(state, None), _choice_text(state, None)
    assert first.reasoning is not second.reasoning and first.reasoning.tokenizer is tokenizer
    first.deltas("a", finished=False)  # content sent: this choice can no longer re-label it
    assert second.message("a</think>b", "stop")[0]["reasoning_content"] == "a"
