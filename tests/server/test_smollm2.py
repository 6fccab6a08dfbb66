"""The bundled default model (SmolLM2-135M-Instruct GGUF) behind the server: real answers."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(start_server, smollm2_path: str) -> Iterator[Any]:
    with start_server(model=smollm2_path, kv_cache_memory=128 << 20, max_model_len=1024) as live:
        yield live


def test_chat_answers_with_the_gguf_chat_template(server) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with server.openai() as client:
        whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=20, temperature=0)
        streamed = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=20,
                                                       temperature=0, stream=True))
    answer = whole.choices[0].message.content
    assert "Paris" in answer
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer
    assert "<|im_end|>" not in answer


def test_completion_stops_at_a_stop_string(server) -> None:
    with server.openai() as client:
        out = client.completions.create(model=server.model, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                        stop=[" 7"])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text.startswith(" 5, 6,") and " 7" not in out.choices[0].text
