"""Request fields that reach the sampler: logit_bias, allowed_token_ids, bad_words,
echo with logprobs, prompt_logprobs, and vLLM's removed guided_* spellings (honoured,
with a warning naming structured_outputs)."""

from __future__ import annotations

import logging

from pagedllm.server import protocol

PROMPT = "The quick brown fox"


def test_logit_bias_moves_the_greedy_token(server) -> None:
    with server.openai() as client:
        plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                          logprobs=0)
        first = plain.choices[0].logprobs.tokens[0]
        first_id = server.engine.engine.tokenizer.convert_tokens_to_ids(
            server.engine.engine.tokenizer.tokenize(first))[0]
        pushed = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                           logit_bias={"42": 100})
        banned = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                           logit_bias={str(first_id): -100})
    tok = server.engine.engine.tokenizer
    assert pushed.choices[0].text == tok.decode([42, 42, 42])
    assert not banned.choices[0].text.startswith(plain.choices[0].text)


def test_allowed_token_ids_and_bad_words(server) -> None:
    tok = server.engine.engine.tokenizer
    with server.openai() as client:
        allowed = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0.9,
                                            seed=1, extra_body={"allowed_token_ids": [50, 60], "ignore_eos": True})
        plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0)
        words = plain.choices[0].text.split()
        assert words, "the greedy output has no word to ban"
        banned = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                           extra_body={"bad_words": [words[0]]})
    assert set(tok.encode(allowed.choices[0].text, add_special_tokens=False)) <= {50, 60}
    assert banned.choices[0].text != plain.choices[0].text


def test_echo_with_logprobs_leads_with_the_prompt(server) -> None:
    prompt_ids = server.engine.engine.tokenizer.encode(PROMPT)
    with server.openai() as client:
        out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                        logprobs=2)
        chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                                echo=True, logprobs=2, stream=True))
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(prompt_ids) + 3
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert lp.tokens[0] == server.engine.engine.tokenizer.decode(prompt_ids[:1])  # unscored, but named
    assert lp.top_logprobs[0] is None and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert out.choices[0].text.startswith(PROMPT)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_prompt_logprobs_field(server) -> None:
    prompt_ids = server.engine.engine.tokenizer.encode(PROMPT)
    with server.client() as http:
        body = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1}).json()
    records = body["choices"][0]["prompt_logprobs"]
    assert len(records) == len(prompt_ids) and records[0] is None
    for token, record in zip(prompt_ids[1:], records[1:]):
        assert str(token) in record and record[str(token)]["logprob"] <= 0


def test_guided_spellings_are_honoured_with_a_warning(server, caplog) -> None:
    protocol._warned.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm.server"):
        fields = protocol.Fields({"guided_choice": ["yes", "no"], "guided_whitespace_pattern": " "})
        params, param = protocol.structured_outputs(fields)
    assert params.choice == ["yes", "no"] and params.whitespace_pattern == " " and param == "guided_choice"
    assert any("structured_outputs" in r.message and "guided_choice" in r.message for r in caplog.records)
    fields = protocol.Fields({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object"}}}})
    params, param = protocol.structured_outputs(fields)
    assert params.json == {"type": "object"} and param == "response_format"


def test_chat_prompt_logprobs(server) -> None:
    with server.client() as http:
        body = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2, "prompt_logprobs": 0}).json()
    records = body["prompt_logprobs"]
    assert records[0] is None and len(records) > 3
    assert all(len(r) == 1 and next(iter(r.values()))["rank"] >= 1 for r in records[1:])
