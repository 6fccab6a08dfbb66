"""The OpenAI API through the official `openai` client (and httpx for vLLM's extra routes)."""

from __future__ import annotations

import json

import openai
import pytest

PROMPT = "The quick brown fox"


def test_models_lists_the_served_name(server) -> None:
    with server.openai() as client:
        models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].model_extra["max_model_len"] == server.engine.engine.max_model_len


def test_health_version_and_metrics_need_no_key(server) -> None:
    with server.client(with_key=False) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        assert http.get("/metrics").status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}])
def test_v1_routes_need_the_api_key(server, headers: dict[str, str]) -> None:
    import httpx

    with httpx.Client(base_url=server.url, headers=headers) as http:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]:
            r = http.request(method, path, json={"prompt": "x"})
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"


def test_completion_usage_counts_prompt_and_completion_tokens(server) -> None:
    with server.openai() as client:
        out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
    num_prompt = len(server.engine.engine.tokenizer.encode(PROMPT))
    assert out.object == "text_completion" and out.model == server.model
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == num_prompt
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == num_prompt + 5
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_prompt_shapes(server) -> None:
    ids = server.engine.engine.tokenizer.encode(PROMPT)
    with server.openai() as client:
        by_text = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0)
        by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=4, temperature=0)
        many = client.completions.create(model=server.model, prompt=[PROMPT, "Hello world"], max_tokens=4,
                                         temperature=0)
        many_ids = client.completions.create(model=server.model, prompt=[ids, ids[:2]], max_tokens=4, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text
    assert many_ids.choices[0].text == by_text.choices[0].text
    assert many.usage.prompt_tokens == len(ids) + len(server.engine.engine.tokenizer.encode("Hello world"))


def test_completion_echo_prepends_the_prompt(server) -> None:
    with server.openai() as client:
        plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0)
        echoed = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_completion_stream_matches_the_whole_answer(server) -> None:
    with server.openai() as client:
        whole = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0)
        chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_framing(server) -> None:
    """Each event is `data: <json>` and a blank line; the stream ends with `data: [DONE]`."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with server.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[len("data: "):])["object"] == "text_completion"


def test_chat_and_chat_stream_agree(server) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    with server.openai() as client:
        whole = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=6,
                                               temperature=0)
        chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=6,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert whole.usage.completion_tokens <= 6


def test_n_choices(server) -> None:
    with server.openai() as client:
        out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, n=3, seed=1,
                                        extra_body={"ignore_eos": True})
        chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, n=2, stream=True)
        indices = {c.choices[0].index for c in chat if c.choices}
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    assert indices == {0, 1}


def test_stop_string_truncates_and_reports_it(server) -> None:
    with server.openai() as client:
        free = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        stop = next(free[i:i + 2] for i in range(2, len(free) - 1) if free[i:i + 2].strip())
        out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
        streamed = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                                  stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert out.choices[0].text == free[:free.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == free[:free.index(stop)]


def test_seed_makes_sampling_reproducible(server) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with server.openai() as client:
        first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first != other


def test_completion_logprobs_shape(server) -> None:
    with server.openai() as client:
        out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                        extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(top.values()) - v) < 1e-5 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_shape(server) -> None:
    with server.openai() as client:
        out = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                             extra_body={"ignore_eos": True})
        streamed = list(client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
            logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())
    streamed_entries = [e for c in streamed if c.choices and c.choices[0].logprobs
                        for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed_entries] == pytest.approx([e.logprob for e in content])


def test_vllm_sampling_extras_are_honoured(server) -> None:
    extras = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 7,
              "presence_penalty": 0.5, "frequency_penalty": 0.5, "skip_special_tokens": False,
              "stop_token_ids": [1]}
    with server.openai() as client:
        out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=7, top_p=0.9, seed=3,
                                        extra_body=extras)
    assert out.usage.completion_tokens == 7


def test_prefix_cache_hits_are_reported_as_cached_tokens(server) -> None:
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
    with server.openai() as client:
        client.completions.create(model=server.model, prompt=prompt, max_tokens=1)
        again = client.completions.create(model=server.model, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= server.engine.engine.config.cache.block_size


def test_tokenize_and_detokenize_round_trip(server) -> None:
    with server.client() as http:
        tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        with server.openai() as client:
            usage = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=1).usage
        assert chat["count"] == usage.prompt_tokens


def test_client_errors_surface_as_openai_exceptions(server) -> None:
    with server.openai() as client:
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="top_p"):
            client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1, top_p=1.5)
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with bad_key, pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_metrics_report_engine_state_and_latencies(server) -> None:
    with server.openai() as client:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3)
    with server.client() as http:
        text = http.get("/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_success_total", "max_num_seqs_per_step", "prefix_cache_queries_total",
                 "prefix_cache_hits_total"]:
        assert f"pagedllm:{name}" in text, name
    generated = next(line for line in text.splitlines() if line.startswith("pagedllm:generation_tokens_total"))
    assert float(generated.split()[-1]) == server.engine.engine.stats.num_generation_tokens
