"""OpenAI request fields: reading, type checks, and the mapping to SamplingParams.

A request body is a JSON object read through `Fields`, which checks each field's type
as it is asked for and raises `APIError` naming the field. Value ranges are mostly
SamplingParams' business: its ValueError names the field, and becomes a 400 with that
`param`; the few checked here are those it cannot know (see `sampling_fields`). Fields
we do not know are ignored (as vLLM does) and logged at debug level; fields we know but
cannot honour yet are rejected, never silently dropped.

The endpoints call these on a request worker (`body.off_loop`), never on the event loop.
What one request may cost there, and in the engine loop every request shares, is bounded
by the limits below: each field whose work grows with its size has a cap, and a request
over one is a 400 naming that field.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

from pagedllm.core.engine import LLMEngine
from pagedllm.core.request import Logprob, RequestOutput, SamplingParams, StructuredOutputsParams
from pagedllm.server.body import strings
from pagedllm.server.errors import APIError

logger = logging.getLogger("pagedllm.server")

MAX_N = 128  # choices per request: each is a sequence in the batch
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_SEED = 2**63 - 1 - MAX_N  # the engine seeds choice i with seed + i
MAX_TOP_K = 2**31 - 1  # larger means "no top-k" anyway, and must fit a tensor
# What grows a request's cost, capped (see the module docstring):
MAX_STOP = 16  # stop strings (OpenAI allows 4): each may be searched for at every step
MAX_STOP_CHARS = 1024  # per stop string: the text searched, and held back, at every step
MAX_STOP_TOKEN_IDS = 256  # each generated token is checked against them
MAX_PROMPTS = 256  # prompts in one /v1/completions request: an engine request each
MAX_CHOICES = 256  # prompts x n: the sequences one request adds to the batch
MAX_MESSAGES = 4096  # chat messages, each rendered by the template
MAX_LOGIT_BIAS = 1024  # logit_bias entries (OpenAI allows 300)
MAX_BAD_WORDS = 256  # bad_words: each is matched against the history at every step
MAX_ALLOWED_TOKEN_IDS = 1 << 20
# vLLM's removed request fields for structured outputs -> the key of `structured_outputs` now used
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
GUIDED_OPTIONS = {"guided_whitespace_pattern": "whitespace_pattern"}
GUIDED_IGNORED = ("guided_decoding_backend",)  # per-request backends: chosen at start-up now
_warned: set[str] = set()
# Text longer than this many characters per token of the context cannot be a prompt that
# fits it (tokens average 3-5 characters), so it is refused before it is tokenized. The
# same bound caps the token ids /detokenize decodes.
CHARS_PER_TOKEN = 32


_MISSING = object()
_KINDS = {
    "any": ("any JSON value", lambda v: True),
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("a boolean", lambda v: isinstance(v, bool)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "str_or_list": ("a string or an array of strings",
                    lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))),
    "int_list": ("an array of integers",
                 lambda v: isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)),
}


def check_count(value: Any, limit: int, param: str, what: str) -> None:
    """400 naming `param` when the array `value` has more than `limit` items."""
    if isinstance(value, list) and len(value) > limit:
        raise APIError(f"'{param}' has {len(value)} {what}; at most {limit} are allowed", param=param,
                       code="invalid_value")


def check_messages(value: Any, max_model_len: int) -> None:
    """400 naming 'messages' for more than MAX_MESSAGES messages, or more text in them than
    `check_text_len` accepts; checked on the raw value, before anything is parsed or rendered."""
    check_count(value, MAX_MESSAGES, "messages", "messages")
    if isinstance(value, list):
        check_text_len(sum(len(text) for text in strings(value, keys=False)), max_model_len, "messages")


def check_text_len(num_chars: int, max_model_len: int, param: str) -> None:
    """400 naming `param` for text too long to be a prompt that fits the context; checked
    before the text is tokenized or rendered, which is where its cost is."""
    limit = CHARS_PER_TOKEN * max_model_len
    if num_chars > limit:
        raise APIError(f"'{param}' has {num_chars} characters; with a context of {max_model_len} tokens "
                       f"at most {limit} are accepted ({CHARS_PER_TOKEN} per token)", param=param,
                       code="context_length_exceeded")


class Fields:
    """Typed access to a request body; every accessor raises APIError naming the field."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.seen: set[str] = set()

    def get(self, name: str, kind: str, default: Any = None, *, required: bool = False) -> Any:
        """The field's value (`default` when absent or null), checked to be of `kind`."""
        self.seen.add(name)
        value = self.data.get(name, _MISSING)
        if value is _MISSING or value is None:
            if required:
                raise APIError(f"'{name}' is a required field", param=name, code="missing_required_parameter")
            return default
        what, ok = _KINDS[kind]
        if not ok(value):
            raise APIError(f"'{name}' must be {what}, got {json.dumps(value)[:80]}", param=name,
                           code="invalid_type")
        if kind == "number":
            try:
                value = float(value)
            except OverflowError:
                value = math.inf
            if not math.isfinite(value):
                raise APIError(f"'{name}' must be a finite number", param=name, code="invalid_value")
        return value

    def int_in(self, name: str, low: int, high: int, default: int | None = None) -> int | None:
        value = self.get(name, "int", default)
        if value is not None and not low <= value <= high:
            raise APIError(f"'{name}' must be between {low} and {high}, got {value}", param=name,
                           code="invalid_value")
        return value

    def reject_unsupported(self, names: dict[str, str]) -> None:
        """400 for fields we understand but cannot honour yet (given with a non-empty value)."""
        for name, why in names.items():
            self.seen.add(name)
            if self.data.get(name) not in (None, False, "", [], {}):
                raise APIError(f"'{name}' is not supported yet: {why}", param=name, code="unsupported")

    def log_unknown(self, endpoint: str) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            logger.debug("%s: ignoring unknown fields %s", endpoint, unknown)


def check_model(fields: Fields, served_names: list[str]) -> str:
    """The model name to report; 404 for a name this server does not serve."""
    name = fields.get("model", "str")
    if name is None:
        return served_names[0]
    if name not in served_names:
        raise APIError(f"the model '{name}' does not exist; this server serves: {', '.join(served_names)}",
                       404, param="model", code="model_not_found")
    return name


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, field: str,
                  prompt_param: str = "prompt") -> int:
    """The number of tokens to generate, within the context window; 400 with both numbers when
    prompt + max_tokens does not fit. An unset max_tokens means 'up to the end of the context',
    so a prompt that fills the context is refused too: there is no room for one token."""
    if prompt_len > max_model_len or (max_tokens is None and prompt_len == max_model_len):
        raise APIError(f"this model's maximum context length is {max_model_len} tokens, but the prompt "
                       f"has {prompt_len} tokens, leaving no room for a generated token; shorten the prompt",
                       param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens, but you asked for "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in "
                       f"'{field}'); lower '{field}' or shorten the prompt", param=field,
                       code="context_length_exceeded")
    return max_tokens


def sampling_fields(fields: Fields) -> dict[str, Any]:
    """The SamplingParams arguments both endpoints share (OpenAI's plus vLLM's extras).

    Ranges SamplingParams cannot check are refused here: a seed that must leave room for
    `n` (the engine seeds choice i with seed + i), a top_k that must fit a tensor, the
    server's limits on `n` and on the number and length of stop strings and stop token ids.
    The model's ranges (stop token ids in the vocabulary) are the engine's `validate_params`,
    asked by `prepare` before a stream's 200 goes out."""
    seed = fields.get("seed", "int")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise APIError(f"'seed' must be between 0 and {MAX_SEED}, got {seed}", param="seed", code="invalid_value")
    check_count(fields.data.get("stop"), MAX_STOP, "stop", "stop strings")
    stop = fields.get("stop", "str_or_list")
    longest = max((len(s) for s in ([stop] if isinstance(stop, str) else stop or [])), default=0)
    if longest > MAX_STOP_CHARS:
        raise APIError(f"'stop' has a string of {longest} characters; at most {MAX_STOP_CHARS} are allowed",
                       param="stop", code="invalid_value")
    check_count(fields.data.get("stop_token_ids"), MAX_STOP_TOKEN_IDS, "stop_token_ids", "token ids")
    stop_token_ids = fields.get("stop_token_ids", "int_list")
    n = fields.int_in("n", 1, MAX_N, 1)
    best_of = fields.get("best_of", "int")
    if best_of is not None and best_of != n:
        raise APIError(f"'best_of' other than n is not supported yet (got best_of={best_of}, n={n})",
                       param="best_of", code="unsupported")
    structured, param = structured_outputs(fields)
    return dict(
        structured_outputs=structured,
        _param_names={"structured_outputs": param},
        logit_bias=logit_bias(fields),
        allowed_token_ids=fields.get("allowed_token_ids", "int_list"),
        bad_words=bad_words(fields),
        prompt_logprobs=fields.int_in("prompt_logprobs", 0, MAX_LOGPROBS),
        n=n,
        temperature=fields.get("temperature", "number", 1.0),
        top_p=fields.get("top_p", "number", 1.0),
        top_k=fields.int_in("top_k", -1, MAX_TOP_K, 0),
        min_p=fields.get("min_p", "number", 0.0),
        seed=seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=fields.get("ignore_eos", "bool", False),
        min_tokens=fields.get("min_tokens", "int", 0),
        presence_penalty=fields.get("presence_penalty", "number", 0.0),
        frequency_penalty=fields.get("frequency_penalty", "number", 0.0),
        repetition_penalty=fields.get("repetition_penalty", "number", 1.0),
        skip_special_tokens=fields.get("skip_special_tokens", "bool", True),
        include_stop_str_in_output=fields.get("include_stop_str_in_output", "bool", False),
    )


def logit_bias(fields: Fields) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}) with integer keys; the ids are checked
    against the vocabulary by the engine (`validate_params`), the values by SamplingParams."""
    value = fields.get("logit_bias", "object")
    if not value:
        return None
    if len(value) > MAX_LOGIT_BIAS:
        raise APIError(f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                       param="logit_bias", code="invalid_value")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(f"'logit_bias' keys must be token ids (integers as strings), got {key!r}",
                           param="logit_bias", code="invalid_value") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise APIError(f"'logit_bias' values must be numbers, got {json.dumps(bias)[:40]} for {key!r}",
                           param="logit_bias", code="invalid_type")
        out[token] = float(bias)
    return out


def bad_words(fields: Fields) -> list[str] | None:
    check_count(fields.data.get("bad_words"), MAX_BAD_WORDS, "bad_words", "words")
    words = fields.get("bad_words", "str_or_list")
    words = [words] if isinstance(words, str) else words
    if words and max(len(w) for w in words) > MAX_STOP_CHARS:
        raise APIError(f"'bad_words' has a word over {MAX_STOP_CHARS} characters", param="bad_words",
                       code="invalid_value")
    return words or None


def structured_outputs(fields: Fields) -> tuple[StructuredOutputsParams | None, str]:
    """The request's output constraint and the field it came from: `structured_outputs`
    (vLLM's), `response_format` (OpenAI's json_schema / json_object), or vLLM's removed
    `guided_*` fields, accepted with a warning naming the current spelling (vLLM itself now
    drops them silently and returns unconstrained text). Two of them at once is a 400."""
    given: list[tuple[str, dict[str, Any]]] = []
    so = fields.get("structured_outputs", "object")
    if so:
        given.append(("structured_outputs", dict(so)))
    rf = fields.get("response_format", "object")
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError("'response_format' of type json_schema needs 'json_schema': {\"name\": ..., "
                               "\"schema\": {...}}", param="response_format", code="invalid_value")
            given.append(("response_format", {"json": spec["schema"]}))
        elif kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "structural_tag":
            given.append(("response_format", {"structural_tag": {k: v for k, v in rf.items() if k != "type"}}))
        elif kind != "text":
            raise APIError(f"'response_format.type' must be text, json_object, json_schema or structural_tag, "
                           f"got {json.dumps(kind)[:40]}", param="response_format", code="invalid_value")
    guided: dict[str, Any] = {}
    for name, key in {**GUIDED_FIELDS, **GUIDED_OPTIONS}.items():
        fields.seen.add(name)
        if fields.data.get(name) is not None:
            _warn_once(name, f"'{name}' is vLLM's removed spelling: send 'structured_outputs': "
                             f"{{\"{key}\": ...}} instead (honoured this time)")
            guided[key] = fields.data[name]
    for name in GUIDED_IGNORED:
        fields.seen.add(name)
        if fields.data.get(name) is not None:
            _warn_once(name, f"'{name}' is ignored: the backend is chosen at start-up with "
                             "--structured-outputs-config '{\"backend\": ...}'")
    if set(guided) - set(GUIDED_OPTIONS.values()):
        given.append((next(n for n in GUIDED_FIELDS if fields.data.get(n) is not None), guided))
    elif guided and given:
        given[-1][1].update(guided)
    if not given:
        return None, "structured_outputs"
    if len(given) > 1:
        names = [n for n, _ in given]
        raise APIError(f"give one output constraint; got {' and '.join(names)}", param=names[1],
                       code="invalid_value")
    param, values = given[0]
    known = set(StructuredOutputsParams.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise APIError(f"'{param}' has unknown keys {unknown}; known: {', '.join(sorted(known))}", param=param,
                       code="invalid_value")
    try:
        return StructuredOutputsParams(**values), param
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc).replace("SamplingParams.structured_outputs", f"'{param}'"), param=param,
                       code="invalid_value") from None


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


_PARAM_NAME = re.compile(r"SamplingParams\.(\w+)")


def make_sampling_params(values: dict[str, Any], llm_engine: LLMEngine | None = None) -> SamplingParams:
    """SamplingParams from checked fields, checked against the engine's model when given;
    a ValueError becomes a 400 naming the field (as the client spelled it: `_param_names`
    maps a SamplingParams field to the request field it came from)."""
    values = dict(values)
    names = values.pop("_param_names", None) or {}
    try:
        params = SamplingParams(**values)
        if llm_engine is not None:
            llm_engine.validate_params(params)
        return params
    except ValueError as exc:
        message = str(exc)
        match = _PARAM_NAME.search(message)
        param = match.group(1) if match else None
        if names.get(param, param) != param:  # say it as the client spelled it
            message = message.replace(f"SamplingParams.{param}", f"'{names[param]}'")
        raise APIError(message, param=names.get(param, param), code="invalid_value") from None


def stream_options(fields: Fields, stream: bool) -> bool:
    """Whether to send a final usage chunk (`stream_options.include_usage`)."""
    options = fields.get("stream_options", "object")
    if options is None:
        return False
    if not stream:
        raise APIError("'stream_options' is only allowed with 'stream': true", param="stream_options",
                       code="invalid_value")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise APIError("'stream_options.include_usage' must be a boolean", param="stream_options",
                       code="invalid_type")
    return include


def usage(finals: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI `usage` over the final outputs of one API request (one per prompt)."""
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def clamp_logprob(value: float) -> float:
    """JSON has no -inf: report impossible tokens as -9999.0, as vLLM does."""
    return value if math.isfinite(value) else -9999.0


def prompt_logprobs_json(final: RequestOutput) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else
    {token id: {"logprob", "rank", "decoded_token"}}."""
    return [None if record is None else
            {str(tid): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in record.items()}
            for record in final.prompt_logprobs or []]


def top_entries(record: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position's logprob record, best first."""
    ranked = sorted(((tid, lp) for tid, lp in record.items() if lp.rank is not None and lp.rank <= k),
                    key=lambda item: item[1].rank)
    return ranked[:k]


def encode_prompt(tokenizer: Any, value: Any, max_model_len: int,
                  param: str = "prompt") -> list[tuple[str | None, list[int]]]:
    """OpenAI's four prompt shapes -> [(text or None, token ids)]: a string, a list of strings,
    a list of token ids, or a list of token-id lists. At most MAX_PROMPTS prompts, and no text
    too long for the context (`check_text_len`), both checked before anything is tokenized."""
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)

    def encode_all(texts: list[str]) -> list[tuple[str | None, list[int]]]:
        for text in texts:
            check_text_len(len(text), max_model_len, param)
        return [(text, tokenizer.encode(text)) for text in texts]

    if isinstance(value, str):
        return encode_all([value])
    if isinstance(value, list) and value:
        if is_ids(value):
            return [(None, list(value))]
        check_count(value, MAX_PROMPTS, param, "prompts")
        if all(isinstance(v, str) for v in value):
            return encode_all(value)
        if all(is_ids(v) for v in value):
            return [(None, list(v)) for v in value]
    raise APIError(f"'{param}' must be a non-empty string, array of strings, array of token ids or array of "
                   "token-id arrays", param=param, code="invalid_type")


def prepare(llm_engine: LLMEngine, prompts: list[tuple[str | None, list[int]]], values: dict[str, Any],
            max_tokens: int | None, field: str, prompt_param: str) -> list[SamplingParams]:
    """Check each prompt against the engine and the context window; one SamplingParams each.

    `field` names the max-tokens field the client used, `prompt_param` the prompt's."""
    n = values.get("n", 1)
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(f"{len(prompts)} prompts with n={n} make {len(prompts) * n} choices; at most "
                       f"{MAX_CHOICES} are allowed per request", param="n", code="invalid_value")
    params = []
    for _, ids in prompts:
        budget = check_context(len(ids), max_tokens, llm_engine.max_model_len, field, prompt_param)
        try:
            llm_engine.validate_prompt(ids)
        except ValueError as exc:
            raise APIError(str(exc), param=prompt_param, code="invalid_value") from None
        params.append(make_sampling_params({**values, "max_tokens": budget}, llm_engine))
    return params
