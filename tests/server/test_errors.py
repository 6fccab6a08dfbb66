"""Every invalid request gets a 4xx with an OpenAI-shaped body; engine errors fail only their request."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from pagedllm.server.app import ServerSettings
from pagedllm.server.chat_template import render_chat
from pagedllm.server.errors import APIError

MAX_BODY = 4096


@pytest.fixture(scope="module")
def server(start_server) -> Iterator[Any]:
    """No API key; a small body limit and context so the limits are cheap to hit."""
    with start_server(ServerSettings(max_request_body_bytes=MAX_BODY), max_model_len=128) as live:
        yield live


def check_error(response: Any, status: int, param: str | None = None, contains: str = "") -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert contains in error["message"], error
    return error


COMPLETIONS_400 = [
    # (body, param, text in the message)
    ({}, "prompt", "required"),
    ({"prompt": 5}, "prompt", "must be"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": [[1, 2], "x"]}, "prompt", "must be"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [10**9]}, "prompt", "outside the vocabulary"),
    ({"prompt": "hi", "max_tokens": "7"}, "max_tokens", "integer"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens", "integer"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "[0, 1e+06]"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", "number"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "hi", "top_k": -5}, "top_k", "between"),
    ({"prompt": "hi", "top_k": 10**30}, "top_k", "between"),
    ({"prompt": "hi", "temperature": 10**400}, "temperature", "finite"),
    ({"prompt": "hi", "min_p": 2}, "min_p", "[0, 1]"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "[1e-06, 1e+06]"),
    ({"prompt": "hi", "n": 0}, "n", "between"),
    ({"prompt": "hi", "n": 10**6}, "n", "between"),
    ({"prompt": "hi", "seed": -1}, "seed", "between"),
    ({"prompt": "hi", "seed": 2**70}, "seed", "between"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs", "between"),
    ({"prompt": "hi", "stop": [""]}, "stop", "empty"),
    ({"prompt": "hi", "stop": 3}, "stop", "string"),
    ({"prompt": "hi", "stop_token_ids": ["a"]}, "stop_token_ids", "integers"),
    ({"prompt": "hi", "stop_token_ids": [10**6], "min_tokens": 1}, "stop_token_ids", "vocabulary"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", "vocabulary"),
    ({"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos", "boolean"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, "min_tokens", "min_tokens"),
    ({"prompt": "hi", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    ({"prompt": "hi", "logit_bias": {"10000000": 5}}, "logit_bias", "vocabulary"),
    ({"prompt": "hi", "logit_bias": {"-1": 5}}, "logit_bias", "vocabulary"),
    ({"prompt": "hi", "logit_bias": {"x": 5}}, "logit_bias", "token ids"),
    ({"prompt": "hi", "logit_bias": {"1": 500}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "hi", "logit_bias": {"1": "a"}}, "logit_bias", "numbers"),
    ({"prompt": "hi", "allowed_token_ids": [10**7]}, "allowed_token_ids", "vocabulary"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ({"prompt": "hi", "bad_words": [""]}, "bad_words", "non-empty"),
    ({"prompt": "hi", "prompt_logprobs": 99}, "prompt_logprobs", "between"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"prompt": "hi", "structured_outputs": {"jsonn": {}}}, "structured_outputs", "unknown keys"),
    ({"prompt": "hi", "structured_outputs": {"choice": "ab"}}, "structured_outputs", "list of strings"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex",
     "one output constraint"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "not supported"),
    ({"prompt": "hi", "max_tokens": 500}, "max_tokens", "128"),
]


@pytest.mark.parametrize("body,param,text", COMPLETIONS_400, ids=[json.dumps(c[0])[:40] for c in COMPLETIONS_400])
def test_bad_completion_requests_are_400(server, body: dict[str, Any], param: str, text: str) -> None:
    with server.client() as http:
        check_error(http.post("/v1/completions", json=body), 400, param, text)


CHAT_400 = [
    ({}, "messages", "required"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": "hi"}, "messages", "non-empty"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "only text"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "response_format", "json_schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
     "response_format", "schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a+"}}, "response_format", "one output constraint"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}, "max_completion_tokens",
     "128"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}, "chat_template",
     "--chat-template"),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
      "continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}}, "messages",
     "chat template"),
]


@pytest.mark.parametrize("body,param,text", CHAT_400, ids=[json.dumps(c[0])[:40] for c in CHAT_400])
def test_bad_chat_requests_are_400(server, body: dict[str, Any], param: str, text: str) -> None:
    with server.client() as http:
        check_error(http.post("/v1/chat/completions", json=body), 400, param, text)


def test_chat_template_failures_are_400(server) -> None:
    state = SimpleNamespace(llm_engine=server.engine.engine, settings=ServerSettings(),
                            chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(APIError) as exc_info:
        render_chat(state, [{"role": "user", "content": "hi"}])
    assert exc_info.value.status_code == 400 and "roles must alternate" in exc_info.value.message


def test_context_overflow_names_both_numbers(server) -> None:
    ids = server.engine.engine.tokenizer.encode("hello world")
    with server.client() as http:
        error = check_error(http.post("/v1/completions", json={"prompt": ids, "max_tokens": 128}), 400, "max_tokens")
        assert error["code"] == "context_length_exceeded"
        assert "128 tokens" in error["message"] and f"{len(ids)} in the prompt" in error["message"]
        too_long = check_error(http.post("/v1/completions", json={"prompt": [5] * 200, "max_tokens": 1}), 400,
                               "prompt", "200 tokens")
        assert too_long["code"] == "context_length_exceeded"


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"", b"\xff\xfe", b"[" * 2000 + b"]" * 2000,
                                 b"[" * 100_000 + b"]" * 100_000])
def test_malformed_json_is_400(server, raw: bytes) -> None:
    with server.client() as http:
        status = 413 if len(raw) > MAX_BODY else 400
        check_error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), status)


def test_oversized_body_is_413_even_without_content_length(server) -> None:
    body = json.dumps({"prompt": "x" * (MAX_BODY * 2)}).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 1024):
            yield body[i:i + 1024]

    with server.client() as http:
        check_error(http.post("/v1/completions", content=body), 413)
        check_error(http.post("/v1/completions", content=chunks()), 413)  # chunked: no Content-Length


def test_unknown_model_is_404(server) -> None:
    with server.client() as http:
        for path, body in [("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
            error = check_error(http.post(path, json={**body, "model": "gpt-9"}), 404, "model", "gpt-9")
            assert error["code"] == "model_not_found"


def test_unknown_route_and_wrong_method(server) -> None:
    with server.client() as http:
        check_error(http.get("/v1/nothing"), 404)
        check_error(http.get("/v1/completions"), 405)


def test_tokenize_and_detokenize_validate(server) -> None:
    with server.client() as http:
        check_error(http.post("/tokenize", json={}), 400, "prompt", "required")
        check_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens", "vocabulary")
        check_error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens", "integers")


def test_unknown_fields_are_ignored(server) -> None:
    with server.client() as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "some_future_field": 1})
        assert r.status_code == 200


def test_engine_error_fails_only_its_request(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises fails the requests in it with a 500 body; the server keeps serving."""
    worker = server.engine.engine.worker
    real_execute = worker.execute
    calls = {"n": 0}

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(worker, "execute", failing_once)
    with server.client() as http:
        error = check_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 500,
                            contains="injected fault")
        assert error["type"] == "server_error"
        calls["n"] = 0
        with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        assert r.status_code == 200
        assert "injected fault" in json.loads(events[-2][len("data: "):])["error"]["message"]
        assert events[-1] == "data: [DONE]"
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    server.wait_idle()


def test_bad_stop_token_ids_are_400_before_a_stream_starts(server) -> None:
    """Checked by the server, not left to the engine: the engine sees the request only
    after a stream's 200 has been sent, and its error names no `param`."""
    with server.client() as http:
        for path, body in [("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
            check_error(http.post(path, json={**body, "stop_token_ids": [10**6], "stream": True}), 400,
                        "stop_token_ids", "vocabulary")
