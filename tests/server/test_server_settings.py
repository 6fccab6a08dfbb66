"""Server settings: --reasoning-parser and --chat-template change what the API returns."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from pagedllm.server.app import ServerSettings, load_chat_template
from pagedllm.server.reasoning import DeepSeekR1ReasoningParser

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def test_chat_template_is_a_file_or_inline_jinja(tmp_path: Any) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither an existing file"):
        load_chat_template("no-such-template.jinja")


@pytest.fixture(scope="module")
def server(start_server) -> Iterator[Any]:
    with start_server(ServerSettings(reasoning_parser="deepseek_r1", chat_template=TEMPLATE)) as live:
        yield live


def test_server_puts_reasoning_in_its_own_field(server) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    with server.openai() as client:
        whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
        chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=6,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True}))
    message = whole.choices[0].message
    # A random model never closes </think>, so everything it says is reasoning (as in vLLM).
    reasoning, content = DeepSeekR1ReasoningParser().split(_plain_text(server, messages), finished=True)
    assert message.model_extra["reasoning_content"] == (reasoning or None)
    assert message.content == (content or None)
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for c in chunks if c.choices)
    assert streamed == reasoning


def _plain_text(server, messages: list[dict[str, str]]) -> str:
    """The unsplit output, from the same engine through /v1/completions on the rendered prompt."""
    with server.client() as http:
        ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        out = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0,
                                                 "ignore_eos": True}).json()
    return out["choices"][0]["text"]


def test_server_uses_the_configured_chat_template(server) -> None:
    with server.client() as http:
        ids = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "[user] hi\n[assistant] "
