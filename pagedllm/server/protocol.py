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
from pagedllm.core.request import Logprob, RequestOutput, SamplingParams
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
    fields.reject_unsupported({
        "logit_bias": "no logits processor for it",
        "guided_json": "structured outputs are not built", "guided_regex": "structured outputs are not built",
        "guided_choice": "structured outputs are not built", "guided_grammar": "structured outputs are not built",
        "prompt_logprobs": "prompt logprobs are not computed",
    })
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
    return dict(
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


_PARAM_NAME = re.compile(r"SamplingParams\.(\w+)")


def make_sampling_params(values: dict[str, Any], llm_engine: LLMEngine | None = None) -> SamplingParams:
    """SamplingParams from checked fields, checked against the engine's model when given;
    a ValueError becomes a 400 naming the field."""
    try:
        params = SamplingParams(**values)
        if llm_engine is not None:
            llm_engine.validate_params(params)
        return params
    except ValueError as exc:
        match = _PARAM_NAME.search(str(exc))
        raise APIError(str(exc), param=match.group(1) if match else None, code="invalid_value") from None


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
