"""Structured outputs through the server on SmolLM2: response_format json_schema and
json_object, structured_outputs (regex, choice), vLLM's removed guided_json honoured,
streamed and whole, at temperature 0 and 0.8; a schema that cannot compile is a 400
naming the field the client used, and the server goes on serving."""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

import jsonschema
import pytest

from pagedllm.server.app import ServerSettings

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    "email": {"type": "string", "maxLength": 40}},
    "required": ["name", "age", "pets"]}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 9},
        "price": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["sku", "qty", "price"]}},
    "status": {"enum": ["new", "paid", "shipped"]}},
    "required": ["id", "items", "status"]}


@pytest.fixture(scope="module")
def smol(start_server, smollm2_path: str) -> Iterator[Any]:
    with start_server(ServerSettings(), model=smollm2_path, kv_cache_memory=128 << 20, max_model_len=2048) as live:
        yield live


def ask(client: Any, model: str, content: str, stream: bool, **kwargs: Any) -> str:
    messages = [{"role": "user", "content": content}]
    if not stream:
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=200, **kwargs)
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        return out.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=200, stream=True,
                                                 **kwargs))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("schema,prompt", [(PERSON, "Describe a person as JSON."),
                                           (ORDER, "Write a shop order as JSON.")], ids=["person", "order"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_outputs_validate(smol, schema, prompt, stream, temperature) -> None:
    with smol.openai() as client:
        text = ask(client, smol.model, prompt, stream, temperature=temperature, seed=5,
                   response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_choice_and_guided_json(smol) -> None:
    with smol.openai() as client:
        obj = ask(client, smol.model, "Give a JSON object with the keys name and age of a person.", False,
                  temperature=0, response_format={"type": "json_object"})
        assert isinstance(json.loads(obj), dict)
        date = ask(client, smol.model, "When did the Apollo 11 landing happen?", True, temperature=0.8, seed=1,
                   extra_body={"structured_outputs": {"regex": r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
        assert re.fullmatch(r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]", date)
        choices = ["positive", "negative", "neutral"]
        out = client.completions.create(model=smol.model, prompt="Sentiment of 'I love it':", max_tokens=10, n=3,
                                        temperature=0.8, seed=2, extra_body={"structured_outputs": {"choice": choices}})
        assert all(c.text in choices for c in out.choices)
        guided = ask(client, smol.model, "Describe a person as JSON.", False, temperature=0,
                     extra_body={"guided_json": PERSON})
        jsonschema.validate(json.loads(guided), PERSON)


def test_a_schema_that_cannot_compile_is_a_400_and_the_server_goes_on(smol) -> None:
    with smol.client() as http:
        bad = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "nonsense"}}}}}})
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == "response_format" and "SamplingParams" not in error["message"]
        regex = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                   "structured_outputs": {"regex": "(unclosed"}})
        assert regex.status_code == 400 and regex.json()["error"]["param"] == "structured_outputs", regex.text
        grammar = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                     "structured_outputs": {"grammar": "root ::= undefined_rule"}})
        assert grammar.status_code == 400 and grammar.json()["error"]["param"] == "structured_outputs"
        fine = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert fine.status_code == 200
    smol.wait_idle()


def test_a_feature_the_backend_lacks_is_a_400_naming_who_has_it(start_server) -> None:
    with start_server(structured_outputs_config={"backend": "outlines"}) as live, live.client() as http:
        out = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                 "structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
        assert out.status_code == 400, out.text
        error = out.json()["error"]
        assert error["param"] == "structured_outputs" and "xgrammar" in error["message"], error
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                  "structured_outputs": {"choice": ["yes", "no"]}}).status_code == 200
