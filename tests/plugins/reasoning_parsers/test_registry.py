"""The parsers reach the server through the plugin registry: lookups, the start-up error
for an unknown name, and a third-party parser registered like a built-in."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

import pagedllm
from pagedllm import cli
from pagedllm.core import plugins
from pagedllm.core.contracts import ReasoningParser
from pagedllm.server.reasoning import (
    available_reasoning_parsers,
    get_reasoning_parser,
    reasoning_parser_class,
)
from pagedllm.server.state import ServerSettings
from tests.plugins.reasoning_parsers._stream import stream


class BracketReasoningParser(ReasoningParser):
    """A third party's format: "[[reasoning]]content"."""

    name: ClassVar[str] = "brackets"
    end_tag: ClassVar[str | None] = "]]"

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        if not text.startswith("[["):
            return ("", "") if not finished and "[[".startswith(text) else ("", text)
        reasoning, tag, content = text[2:].partition("]]")
        if tag:
            return reasoning, content
        held = 1 if not finished and reasoning.endswith("]") else 0
        return reasoning[:len(reasoning) - held], ""


class BracketPlugin:
    @pagedllm.hookimpl
    def pagedllm_reasoning_parsers(self) -> dict[str, type[ReasoningParser]]:
        return {BracketReasoningParser.name: BracketReasoningParser}


@pytest.fixture
def bracket_plugin(monkeypatch: pytest.MonkeyPatch) -> plugins.PluginRegistry:
    """A registry with the built-ins and the third-party plugin, used by the lookups."""
    pm = plugins.build_plugin_manager()
    pm.register(BracketPlugin(), name="brackets")
    registry = plugins.PluginRegistry(pm)
    monkeypatch.setattr("pagedllm.server.reasoning.get_registry", lambda: registry)
    return registry


def test_the_built_ins_are_registered_under_their_names() -> None:
    parsers = available_reasoning_parsers()
    assert {"deepseek_r1", "qwen3", "granite"} <= set(parsers)
    for name, cls in parsers.items():
        assert cls.name == name and issubclass(cls, ReasoningParser)


def test_lookup_builds_a_fresh_parser_with_the_tokenizer() -> None:
    tokenizer = object()
    first, second = get_reasoning_parser("qwen3", tokenizer), get_reasoning_parser("qwen3", tokenizer)
    assert first is not second and first.tokenizer is tokenizer
    assert reasoning_parser_class("qwen3").end_tag == "</think>"


def test_unknown_name_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown --reasoning-parser 'qwen9'") as info:
        reasoning_parser_class("qwen9")
    for name in ("deepseek_r1", "granite", "qwen3"):
        assert name in str(info.value)


def test_server_settings_reject_an_unknown_parser() -> None:
    with pytest.raises(ValueError, match="deepseek_r1"):
        ServerSettings(reasoning_parser="nope")


def test_serve_exits_2_listing_the_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "/some/model", "--reasoning-parser", "nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown --reasoning-parser 'nope'" in err and "qwen3" in err and "Traceback" not in err


def test_a_third_party_parser_is_found_by_name(bracket_plugin: Any) -> None:
    assert {"brackets", "deepseek_r1"} <= set(available_reasoning_parsers())
    parser = get_reasoning_parser("brackets")
    assert parser.split("[[think]]answer", finished=True) == ("think", "answer")
    assert stream(get_reasoning_parser("brackets"), "[[a]b]]c", 1) == ("a]b", "c")
    ServerSettings(reasoning_parser="brackets")  # accepted at start-up


def test_a_plugin_cannot_take_over_a_built_in_name() -> None:
    class Impostor(BracketReasoningParser):
        name: ClassVar[str] = "qwen3"

    class Takeover:
        @pagedllm.hookimpl
        def pagedllm_reasoning_parsers(self) -> dict[str, type[ReasoningParser]]:
            return {"qwen3": Impostor}

    pm = plugins.build_plugin_manager()
    pm.register(Takeover(), name="takeover")
    with pytest.raises(ValueError, match="two plugins define the reasoning parser 'qwen3'"):
        plugins.PluginRegistry(pm)
