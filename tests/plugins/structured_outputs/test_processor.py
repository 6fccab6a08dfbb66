"""The structured-outputs processor and its backends on the real SmolLM2 tokenizer, without
running the model: every backend allows each token of a valid output and refuses a wrong
one without moving, rolls back exactly, allows EOS only at a complete match, clears the
bits past the tokenizer's vocabulary; the reasoning gate leaves the reasoning section free
and rolls back across its end; names, options and specs are checked."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.core.contracts import LogitsProcessorContext, bitmask_words, unpack_bitmask
from pagedllm.core.request import StructuredOutputsParams
from pagedllm.plugins.structured_outputs.backends import UnsupportedSpec, canonical_name, load_backend
from pagedllm.plugins.structured_outputs.backends.outlines import escape_regex, ignored_keywords
from pagedllm.plugins.structured_outputs.compiler import CompileJob
from pagedllm.plugins.structured_outputs.factory import StructuredOutputsFactory
from pagedllm.plugins.structured_outputs.processor import MaskLayout, ReasoningGate, StructuredOutputsProcessor
from pagedllm.plugins.structured_outputs.spec import CompileSpec, close_objects, normalize_structural_tag

BACKENDS = ["guidance", "xgrammar", "outlines"]
PAD = 45  # logits wider than the tokenizer, and not a multiple of 32
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
INSTANCE = '{"name": "Ada", "age": 36}'


@pytest.fixture(scope="module")
def parts(llm):
    tok = llm.get_tokenizer()
    return tok, len(tok) + PAD, tuple(llm.engine.eos_token_ids)


@pytest.fixture(scope="module")
def backends(parts):
    return {name: load_backend(name, *parts) for name in BACKENDS}


def context(parts, reasoning_end=None, **options):
    tok, vocab, eos = parts
    return LogitsProcessorContext(tok, vocab, eos, options, reasoning_end)


class Done(CompileJob):
    def __init__(self, grammar):
        super().__init__(CompileSpec("regex", ""), 1.0)
        self.future.set_result(grammar)


def processor(parts, backends, name, spec, gate=None):
    tok, vocab, eos = parts
    return StructuredOutputsProcessor(Done(backends[name].compile(spec)), MaskLayout(vocab, len(tok), eos), gate)


def mask_of(proc, vocab):
    bitmask = torch.full((2, bitmask_words(vocab)), -1, dtype=torch.int32)
    proc.fill_bitmask(bitmask, 1)
    assert bool((bitmask[0] == -1).all()), "a processor wrote outside its row"
    return unpack_bitmask(bitmask[1:], vocab)[0]


def refused(mask, tok):
    """An ordinary token (not special) the mask refuses."""
    special = len(tok.get_added_vocab())
    return special + int((~mask[special:len(tok)]).nonzero()[0])


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------- names and specs


def test_backend_names():
    assert canonical_name("llguidance") == "guidance" and canonical_name("XGrammar") == "xgrammar"
    assert canonical_name("auto") == "auto"
    with pytest.raises(ValueError, match="auto, xgrammar, guidance, llguidance, outlines"):
        canonical_name("lmformat")


def test_factory_checks_its_options(parts):
    with pytest.raises(ValueError, match="valid backends"):
        StructuredOutputsFactory(context(parts, backend="nope"))
    with pytest.raises(ValueError, match="compile_timeout_s"):
        StructuredOutputsFactory(context(parts, compile_timeout_s=0))
    params = type("P", (), {"structured_outputs": None})()
    assert StructuredOutputsFactory(context(parts)).create(params, [1]) is None


def test_spec_folds_engine_options_and_closes_objects():
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"minimum": {"type": "integer"}}},
                                               "b": {"type": "object", "additionalProperties": True}}}
    closed = close_objects(nested)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True  # said otherwise: kept
    so = StructuredOutputsParams(json=json.dumps(nested))
    assert json.loads(CompileSpec.from_params(so, {}).text) == closed  # closed by default
    spec = CompileSpec.from_params(so, {"disable_any_whitespace": True})
    assert json.loads(spec.text) == closed and spec.disable_any_whitespace
    assert CompileSpec.from_params(StructuredOutputsParams(regex="a+"), {"disable_any_whitespace": True}) \
        == CompileSpec("regex", "a+")
    with pytest.raises(ValueError, match=r"^SamplingParams\.structured_outputs: json is not valid JSON"):
        CompileSpec.from_params(StructuredOutputsParams(json="{not json"), {})


def test_structural_tag_forms():
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]}
    fmt = normalize_structural_tag(json.dumps(legacy))["format"]
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<f="]
    assert fmt["tags"] == [{"type": "tag", "begin": "<f=a>", "end": "</f>",
                            "content": {"type": "json_schema", "json_schema": {"type": "object"}}}]
    with pytest.raises(ValueError, match="starts with none of the triggers"):
        normalize_structural_tag({**legacy, "triggers": ["<g="]})
    with pytest.raises(ValueError, match="xgrammar's format"):
        normalize_structural_tag({"type": "structural_tag"})


def test_outlines_keyword_scan_and_escaping():
    schema = {"type": "object", "properties": {"minimum": {"type": "integer", "maximum": 3}},
              "anyOf": [{"uniqueItems": True}], "enum": [{"multipleOf": 2}]}
    assert ignored_keywords(schema) == ["maximum", "uniqueItems"]  # not the property name, not enum values
    assert escape_regex("a.b (c)\n") == "a\\.b \\(c\\)\\n"


@pytest.mark.parametrize("tokenizer_size,vocab", [(100, 145), (96, 130), (64, 64)])
def test_mask_layout_clears_padding_and_sets_eos(tokenizer_size, vocab):
    layout = MaskLayout(vocab, tokenizer_size, (0, 33, 500))  # 500: outside, ignored
    bitmask = torch.full((2, bitmask_words(vocab)), -1, dtype=torch.int32)
    layout.finish(bitmask, 1, allow_eos=False)
    row = unpack_bitmask(bitmask, vocab)[1]
    assert row[:tokenizer_size].sum() == tokenizer_size - 2 and not row[[0, 33]].any()
    assert not row[tokenizer_size:].any() and bool((bitmask[0] == -1).all())
    bitmask[1] = 0
    layout.finish(bitmask, 1, allow_eos=True)
    assert unpack_bitmask(bitmask, vocab)[1].nonzero().flatten().tolist() == [0, 33]


# ---------------------------------------------------------------------- every backend


@pytest.mark.parametrize("name", BACKENDS)
def test_follows_a_valid_output_and_refuses_without_moving(parts, backends, name):
    tok, vocab, eos = parts
    proc = processor(parts, backends, name, CompileSpec("json", json.dumps(PERSON)))
    tokens = ids(tok, INSTANCE)
    masks = []
    for t in tokens:
        mask = mask_of(proc, vocab)
        masks.append(mask)
        assert mask[t], f"{name}: token {t} ({tok.decode([t])!r}) of a valid output is masked out"
        assert not mask[len(tok):].any(), f"{name}: bits past the tokenizer's vocabulary are set"
        assert not mask[list(eos)].any(), f"{name}: EOS allowed before the object is complete"
        wrong = refused(mask, tok)
        assert not proc.accept([wrong]) and torch.equal(mask_of(proc, vocab), mask)
        assert proc.accept([t])
        wrong_next = refused(mask_of(proc, vocab), tok)
        proc.rollback(1)
        assert not proc.accept([t, wrong_next]) and torch.equal(mask_of(proc, vocab), mask)  # all or nothing
        assert proc.accept([t])
    end = mask_of(proc, vocab)
    assert end[list(eos)].all() and not proc.is_terminated()
    for k in (1, 5, len(tokens)):
        proc.rollback(k)
        assert torch.equal(mask_of(proc, vocab), masks[len(tokens) - k]), f"{name}: rollback({k})"
        assert proc.accept(tokens[len(tokens) - k:])
    assert proc.accept([eos[0]]) and proc.is_terminated()
    assert not proc.accept([tokens[0]])
    proc.rollback(1)
    assert not proc.is_terminated() and torch.equal(mask_of(proc, vocab), end)


@pytest.mark.parametrize("name", ["guidance", "xgrammar"])
def test_objects_closed_unless_the_schema_opens_them(parts, backends, name):
    tok = parts[0]
    for extra, allowed in ((None, False), (True, True), ({"type": "integer"}, True)):
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        if extra is not None:
            schema["additionalProperties"] = extra
        so = StructuredOutputsParams(json=schema)
        proc = processor(parts, backends, name, CompileSpec.from_params(so, {}))
        assert proc.accept(ids(tok, '{"a": 1'))
        assert proc.accept(ids(tok, ', "zz": 2}')) is allowed, f"{name}: additionalProperties={extra}"


@pytest.mark.parametrize("name", BACKENDS)
def test_choice_and_regex_literals(parts, backends, name):
    tok, vocab, _ = parts
    choices = ['say "hi" (twice)', "back\\slash", "line\nbreak", "a.b*c"]
    for choice in choices:
        proc = processor(parts, backends, name, CompileSpec("choice", json.dumps(choices)))
        tokens = ids(tok, choice)
        assert proc.accept(tokens[:-1]) and not mask_of(proc, vocab)[list(parts[2])].any()
        assert proc.accept(tokens[-1:]) and mask_of(proc, vocab)[list(parts[2])].all(), f"{name}: {choice!r}"
    proc = processor(parts, backends, name, CompileSpec("regex", r"[0-9]{3}-[a-z]+"))
    assert proc.accept(ids(tok, "123-abc"))
    assert not proc.accept(ids(tok, "-"))


@pytest.mark.parametrize("name", ["guidance", "xgrammar"])
@pytest.mark.parametrize("grammar", [
    'root ::= "The answer is " [0-9]+ "."',  # GBNF / EBNF
    'start: "The answer is " NUM "."\nNUM: /[0-9]+/',  # Lark
], ids=["ebnf", "lark"])
def test_grammar_formats(parts, backends, name, grammar):
    tok, vocab, eos = parts
    proc = processor(parts, backends, name, CompileSpec("grammar", grammar))
    assert proc.accept(ids(tok, "The answer is 42"))
    assert not mask_of(proc, vocab)[list(eos)].any()
    assert not proc.accept(ids(tok, "!"))
    assert proc.accept(ids(tok, ".")) and mask_of(proc, vocab)[list(eos)].all()


def test_outlines_refuses_grammars_naming_who_can(backends):
    with pytest.raises(UnsupportedSpec, match="does not support grammar; backends that do: guidance, xgrammar"):
        backends["outlines"].compile(CompileSpec("grammar", 'root ::= "a"'))
    with pytest.raises(UnsupportedSpec, match=r"ignore the schema keywords \['maximum', 'minimum'\]"):
        backends["outlines"].compile(CompileSpec("json", json.dumps({"type": "integer", "minimum": 0, "maximum": 9})))


@pytest.mark.parametrize("name", ["guidance", "xgrammar"])
def test_structural_tag(parts, backends, name):
    tok = parts[0]
    legacy = {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=add>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                        "required": ["x"]}, "end": "</f>"}]}
    spec = CompileSpec("structural_tag", json.dumps(normalize_structural_tag(legacy)))
    proc = processor(parts, backends, name, spec)
    assert proc.accept(ids(tok, 'Sure. <f=add>{"x": 1'))
    assert not proc.accept(ids(tok, '"')), f"{name}: a string where the schema wants an integer"
    assert proc.accept(ids(tok, "}</f> Done."))


def test_auto_falls_back_when_the_default_refuses(parts, caplog):
    so = StructuredOutputsParams(json=PERSON, whitespace_pattern=" ?")  # xgrammar has no whitespace_pattern
    params = type("P", (), {"structured_outputs": so})()
    factory = StructuredOutputsFactory(context(parts))
    assert factory.compiler.order == ["xgrammar", "guidance", "outlines"]
    with caplog.at_level("INFO", logger="pagedllm"):
        factory.validate(params)
    assert "compiled the json schema with the guidance backend instead" in caplog.text
    for options in ({"backend": "xgrammar"}, {"disable_fallback": True}):
        with pytest.raises(ValueError, match="xgrammar backend has no whitespace_pattern; backends that do"):
            StructuredOutputsFactory(context(parts, **options)).validate(params)
    only_xgrammar = {"type": "structural_tag", "format": {"type": "const_string", "value": "fixed"}}
    params = type("P", (), {"structured_outputs": StructuredOutputsParams(structural_tag=only_xgrammar)})()
    with pytest.raises(ValueError, match="guidance backend supports only plain triggered_tags"):
        StructuredOutputsFactory(context(parts, backend="guidance")).validate(params)
    factory.validate(params)


def test_auto_without_xgrammar_installed(parts, monkeypatch, caplog):
    from pagedllm.plugins.structured_outputs import compiler

    real = compiler.load_backend

    def load(name, *args):
        if name == "xgrammar":
            raise UnsupportedSpec("the xgrammar backend is not available: No module named 'xgrammar'")
        return real(name, *args)

    monkeypatch.setattr(compiler, "load_backend", load)
    factory = StructuredOutputsFactory(context(parts))
    with caplog.at_level("INFO", logger="pagedllm"):
        for schema in (PERSON, {"type": "array", "items": {"type": "integer"}}):
            factory.validate(type("P", (), {"structured_outputs": StructuredOutputsParams(json=schema)})())
    assert caplog.text.count("xgrammar backend is not available") == 1 and "instead" not in caplog.text


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kind,spec,problem", [
    ("json", '{"type": "objekt"}', "objekt"),
    ("regex", "(abc", "regex"),
])
def test_invalid_specs_name_the_field_and_problem(parts, name, kind, spec, problem):
    factory = StructuredOutputsFactory(context(parts, backend=name))
    params = type("P", (), {"structured_outputs": StructuredOutputsParams(**{kind: spec})})()
    with pytest.raises(ValueError, match=r"^SamplingParams\.structured_outputs: ") as info:
        factory.validate(params)
    assert problem in str(info.value).lower(), str(info.value)
    proc = factory.create(params, [1])  # the cached failure reaches a processor too
    assert not proc.ready() and proc.failure() == str(info.value)


def test_cache_hit_is_ready_at_once(parts):
    factory = StructuredOutputsFactory(context(parts))
    params = type("P", (), {"structured_outputs": StructuredOutputsParams(json=PERSON)})()
    factory.validate(params)
    again = type("P", (), {"structured_outputs": StructuredOutputsParams(json=json.dumps(PERSON))})()
    assert factory.compiler.job(factory.spec(again)) is factory.compiler.job(factory.spec(params))
    assert factory.create(again, [1]).ready()


def test_tiny_compile_timeout(parts):
    wide = {"type": "object", "properties": {f"f{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                                             for i in range(30)}, "required": [f"f{i}" for i in range(30)]}
    factory = StructuredOutputsFactory(context(parts, backend="xgrammar", compile_timeout_s=1e-4))
    params = type("P", (), {"structured_outputs": StructuredOutputsParams(json=wide)})()
    proc = factory.create(params, [1])  # the asynchronous path sees the same deadline
    with pytest.raises(ValueError, match=r"^SamplingParams\.structured_outputs: compiling the json schema took "
                                         r"longer than compile_timeout_s=0\.0001 s"):
        factory.validate(params)
    assert not proc.ready() and "compile_timeout_s" in (proc.failure() or "")
    factory.close()


# ---------------------------------------------------------------------- the reasoning gate


@pytest.mark.parametrize("name", ["guidance", "xgrammar"])
def test_reasoning_gate(parts, backends, name):
    tok, vocab, eos = parts
    spec = CompileSpec("json", json.dumps(PERSON))
    proc = processor(parts, backends, name, spec, ReasoningGate(tok, "</think>"))
    thinking = ids(tok, "<think>The user wants JSON. Not yet: ]]] </thi")
    for t in thinking:  # anything goes, and the mask stays untouched
        assert bool(mask_of(proc, vocab).all()) and proc.accept([t])
    assert proc.in_reasoning
    closing = ids(tok, "nk>")
    assert proc.accept(closing) and not proc.in_reasoning
    after = mask_of(proc, vocab)
    assert not after.all() and after[ids(tok, "{")[0]] and not after[ids(tok, "x")[0]]
    body = ids(tok, INSTANCE)
    assert proc.accept(body)
    proc.rollback(len(body) + 1)  # back across the token that ended the reasoning
    assert proc.in_reasoning and bool(mask_of(proc, vocab).all())
    assert proc.accept(closing[-1:]) and torch.equal(mask_of(proc, vocab), after)
    assert proc.accept(body) and proc.accept([eos[0]]) and proc.is_terminated()


def test_enable_in_reasoning_constrains_from_the_start(parts):
    params = type("P", (), {"structured_outputs": StructuredOutputsParams(json=PERSON)})()
    tok = parts[0]
    gated = StructuredOutputsFactory(context(parts, reasoning_end="</think>"))
    gated.validate(params)
    assert gated.create(params, [1]).in_reasoning
    always = StructuredOutputsFactory(context(parts, reasoning_end="</think>", enable_in_reasoning=True))
    always.validate(params)
    proc = always.create(params, [1])
    assert not proc.in_reasoning and not proc.accept(ids(tok, "<think>"))


def test_a_prompt_that_closed_the_reasoning_constrains_from_the_start(parts):
    """Qwen3's enable_thinking=False writes `<think>\\n\\n</think>\\n\\n` into the generation
    prompt: nothing is left to wait for."""
    params = type("P", (), {"structured_outputs": StructuredOutputsParams(json=PERSON)})()
    tok = parts[0]
    factory = StructuredOutputsFactory(context(parts, reasoning_end="</think>"))
    factory.validate(params)
    closed = ids(tok, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not factory.create(params, closed).in_reasoning
    assert factory.create(params, ids(tok, "<|im_start|>assistant\n")).in_reasoning
    assert factory.create(params, ids(tok, "</think> then a question?")).in_reasoning
