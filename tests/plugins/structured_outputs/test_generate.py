"""Structured outputs end to end on SmolLM2-135M (backend "auto"): JSON schemas of every
common shape give outputs that parse and validate, greedy and sampled (seeded, n=2);
regex, choice, grammar, json_object and structural-tag outputs match; bad specs are
ValueErrors naming the field; a request whose grammar is still compiling waits while
the unconstrained request beside it finishes."""

from __future__ import annotations

import json
import re
import threading

import pytest

from pagedllm import SamplingParams
from pagedllm.core.request import StructuredOutputsParams as SO
from tests.plugins.structured_outputs.conftest import assert_valid_json, chat_prompt

SCHEMAS = {
    "nested": ("Give a book with its title and author (first and last name) as JSON.", {
        "type": "object", "required": ["book"], "properties": {"book": {
            "type": "object", "required": ["title", "author"], "properties": {
                "title": {"type": "string", "maxLength": 40},
                "author": {"type": "object", "required": ["first", "last"], "properties": {
                    "first": {"type": "string", "maxLength": 20}, "last": {"type": "string", "maxLength": 20}}}}}}}),
    "enums": ("Pick a color and a t-shirt size, as JSON.", {
        "type": "object", "required": ["color", "size"], "properties": {
            "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}}}),
    "arrays": ("List a few fruits as JSON.", {
        "type": "object", "required": ["fruits"], "properties": {
            "fruits": {"type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 2, "maxItems": 4}}}),
    "bounds": ("Give today's weather in Paris as JSON with temperature and humidity.", {
        "type": "object", "required": ["temperature", "humidity"], "properties": {
            "temperature": {"type": "number", "minimum": -30, "maximum": 45},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100}}}),
    "optional": ("Describe a city as JSON.", {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30},
            "population": {"type": "integer", "minimum": 0}}}),
    "person": ("Describe a famous scientist as JSON with name and age.", {
        "type": "object", "required": ["name", "age"], "properties": {
            "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}),
}


def generate_one(llm, text, **so):
    params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=SO(**so))
    return llm.generate([chat_prompt(llm, text)], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schemas_validate(llm, temperature):
    names = list(SCHEMAS)
    prompts = [chat_prompt(llm, SCHEMAS[n][0]) for n in names]
    params = [SamplingParams(temperature=temperature, seed=7, n=2, max_tokens=128,
                             structured_outputs=SO(json=SCHEMAS[n][1]))
              for n in names]
    for name, out in zip(names, llm.generate(prompts, params, use_tqdm=False)):
        assert len(out.outputs) == 2
        for i, c in enumerate(out.outputs):
            assert c.finish_reason == "stop", f"{name}[{i}] did not finish: {c.text!r}"
            value = assert_valid_json(c.text, SCHEMAS[name][1], f"{name}[{i}] at T={temperature}")
            assert set(value) <= set(SCHEMAS[name][1]["properties"]), "objects are closed by default"


def test_compact_json(llm):
    text, schema = SCHEMAS["person"]
    out = generate_one(llm, text, json=schema, disable_any_whitespace=True)
    value = assert_valid_json(out.text, schema, "compact")
    assert out.text == json.dumps(value, separators=(",", ":"), ensure_ascii=False), out.text


def test_regex_choice_grammar(llm):
    out = generate_one(llm, "What is the phone number of the pizza place?", regex=r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}")
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", out.text), out.text
    choices = ["positive", "negative", "neutral"]
    out = generate_one(llm, "Is 'I loved this film' positive or negative?", choice=choices)
    assert out.text in choices and out.finish_reason == "stop"
    for grammar in ('root ::= "The answer is " [0-9]+ "."', 'start: "The answer is " /[0-9]+/ "."'):
        out = generate_one(llm, "What is 6 times 7?", grammar=grammar)
        assert re.fullmatch(r"The answer is [0-9]+\.", out.text), out.text


def test_json_object_and_whitespace_pattern(llm):
    text = "Give a JSON object with the keys name and color for a cat."
    free = generate_one(llm, text, json_object=True)
    assert free.finish_reason == "stop" and isinstance(json.loads(free.text), dict), free.text
    tight = generate_one(llm, text, json_object=True, whitespace_pattern=" ?")  # one space at most, no newline
    assert tight.finish_reason == "stop" and isinstance(json.loads(tight.text), dict), tight.text
    assert "\n" not in tight.text and "  " not in tight.text, tight.text


def test_structural_tag(llm):
    tag = {"type": "structural_tag", "triggers": ["<weather="], "structures": [
        {"begin": "<weather=get>", "end": "</weather>", "schema": {
            "type": "object", "required": ["city"], "additionalProperties": False,
            "properties": {"city": {"type": "string", "maxLength": 20}}}}]}
    params = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=SO(structural_tag=tag))
    prompt = chat_prompt(llm, "Call the weather tool for Paris: write <weather=get>{\"city\": \"Paris\"}</weather>.")
    text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    for body in re.findall(r"<weather=get>(.*?)</weather>", text, flags=re.DOTALL):
        assert_valid_json(body, tag["structures"][0]["schema"], "tag body")
    assert "<weather=" not in re.sub(r"<weather=get>.*?</weather>", "", text, flags=re.DOTALL), text


@pytest.mark.parametrize("so,problem", [
    ({"json": '{"type": "objekt"}'}, "objekt"),
    ({"json": "{not json"}, "not valid json"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
])
def test_bad_specs_are_value_errors(llm, so, problem):
    with pytest.raises(ValueError, match=r"SamplingParams\.structured_outputs: ") as info:
        llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=SO(**so)), use_tqdm=False)
    assert problem in str(info.value).lower()
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_compiling_request_waits_while_others_run(llm, monkeypatch):
    """create() without validate: the constrained request waits for its compile (held on
    an event here) and the unconstrained one beside it finishes; then it runs and matches."""
    factory = next(f for f in llm.engine.logits_factories if f.name == "structured_outputs")
    gate = threading.Event()
    backend = factory.compiler.get_backend(factory.compiler.order[0])
    compile_real = backend.compile

    def held(spec):
        assert gate.wait(30)
        return compile_real(spec)

    monkeypatch.setattr(factory, "validate", lambda params: None)
    monkeypatch.setattr(backend, "compile", held)
    engine = llm.engine
    regex = r"[a-z]{3}-[0-9]{4}-held"
    engine.add_request("held", "Write a code:", SamplingParams(temperature=0, max_tokens=32,
                                                               structured_outputs=SO(regex=regex)))
    engine.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    finished = {}
    while "free" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "held" not in finished and engine.num_waiting == 1
    gate.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["free"].outputs[0].token_ids and finished["held"].error is None
    assert re.fullmatch(regex, finished["held"].outputs[0].text), finished["held"].outputs[0].text
