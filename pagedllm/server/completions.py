"""POST /v1/completions: OpenAI's legacy text completions, with vLLM's extra fields.

A request with several prompts becomes one engine request per prompt; choice
`i * n + j` is choice j of prompt i, as in OpenAI's API. Everything is validated
before the first engine request starts, so a bad request never costs a KV block; the
checks and the tokenizing run on a request worker, so they never stall the event loop.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, NamedTuple

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.core.request import CompletionOutput, Logprob, RequestOutput, SamplingParams
from pagedllm.server.body import off_loop, read_json
from pagedllm.server.protocol import (
    MAX_LOGPROBS,
    Fields,
    check_model,
    clamp_logprob,
    encode_prompt,
    prepare,
    prompt_logprobs_json,
    sampling_fields,
    stream_options,
    top_entries,
    usage,
)
from pagedllm.server.state import ServerState, state_of
from pagedllm.server.streaming import generate_all, respond


def logprobs_object(token_ids: list[int], records: list[dict[int, Logprob] | None], k: int,
                    text_offset: int, unscored_text: str = "") -> dict[str, Any]:
    """OpenAI's completions logprobs object for these tokens and their logprob records,
    text offsets counted from `text_offset`. A record of None (an echoed prompt's first
    token: nothing predicts it) reports null logprobs, with `unscored_text` as its text."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, record in zip(token_ids, records):
        if record is None:
            text, logprob, top = unscored_text, None, None
        else:
            chosen = record[token_id]
            text, logprob = chosen.decoded_token or "", clamp_logprob(chosen.logprob)
            top = {lp.decoded_token or "": clamp_logprob(lp.logprob) for _, lp in top_entries(record, k)}
            top.setdefault(text, logprob)
        tokens.append(text)
        token_logprobs.append(logprob)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def completion_logprobs(out: CompletionOutput, start: int, k: int, text_offset: int) -> dict[str, Any]:
    """The logprobs object of `out`'s tokens from index `start` on."""
    return logprobs_object(out.token_ids[start:], (out.logprobs or [])[start:], k, text_offset)


class CompletionRequest(NamedTuple):
    """A checked /v1/completions request, its prompts tokenized."""

    model: str
    prompts: list[tuple[str | None, list[int]]]
    params: list[SamplingParams]
    echoes: list[str]  # per prompt: its text when `echo`, else ""
    num_logprobs: int | None
    echo_logprobs: bool  # `echo` with `logprobs`: the prompt's tokens lead the logprobs
    first_tokens: list[str]  # per prompt, with echo_logprobs: its first token's text (no logprob)
    prompt_logprobs: int | None  # vLLM's prompt_logprobs field: a per-choice list
    stream: bool
    include_usage: bool


def read_completion_request(state: ServerState, fields: Fields) -> CompletionRequest:
    """Check every field, then tokenize the prompts: CPU work, run on a request worker
    (`off_loop`). The cheap checks come first, so a request refused for a field costs no
    tokenizing."""
    model = check_model(fields, state.model_names)
    prompt = fields.get("prompt", "any", required=True)
    fields.reject_unsupported({"suffix": "insertion is not built"})
    echo = fields.get("echo", "bool", False)
    num_logprobs = fields.int_in("logprobs", 0, MAX_LOGPROBS)
    stream = fields.get("stream", "bool", False)
    include_usage = stream_options(fields, stream)
    max_tokens = fields.get("max_tokens", "int", 16)
    values = {**sampling_fields(fields), "logprobs": num_logprobs}
    if echo and num_logprobs is not None:  # the echoed prompt's tokens carry logprobs too
        values["prompt_logprobs"] = max(values.get("prompt_logprobs") or 0, num_logprobs)
    fields.get("user", "str")  # accepted, unused
    fields.log_unknown("/v1/completions")
    tokenizer = state.llm_engine.tokenizer
    prompts = encode_prompt(tokenizer, prompt, state.llm_engine.max_model_len)
    params = prepare(state.llm_engine, prompts, values, max_tokens, "max_tokens", "prompt")
    echoes = [(text if text is not None else tokenizer.decode(ids)) if echo else "" for text, ids in prompts]
    echo_logprobs = echo and num_logprobs is not None
    first_tokens = [tokenizer.decode(ids[:1]) if echo_logprobs else "" for _, ids in prompts]
    return CompletionRequest(model, prompts, params, echoes, num_logprobs, echo_logprobs, first_tokens,
                             fields.data.get("prompt_logprobs"), stream, include_usage)


async def create_completion(request: Request) -> Response:
    """One or more prompts, `n` choices each; whole or streamed (see `_chunks`)."""
    state = state_of(request)
    fields = Fields(await read_json(request, state.settings.max_request_body_bytes))
    req = await off_loop(read_completion_request, state, fields)
    model, prompts, params, stream = req.model, req.prompts, req.params, req.stream

    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = generate_all(state.engine, state.metrics, request_id, prompts, params)
    head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
    n = params[0].n
    return await respond(request, streams, stream,
                         chunks=lambda outputs: _chunks(outputs, head, n, req),
                         answer=lambda finals: _answer(finals, head, n, req))


def _led_by_prompt(final: RequestOutput, req: CompletionRequest, prompt_index: int,
                   ours: dict[str, Any]) -> dict[str, Any]:
    """A choice's logprobs object `ours` led by its echoed prompt's tokens (echo with
    logprobs: the first prompt token with null logprobs, as OpenAI reports them)."""
    lead = logprobs_object(final.prompt_token_ids, final.prompt_logprobs or [], req.num_logprobs or 0, 0,
                           req.first_tokens[prompt_index])
    return {key: lead[key] + ours[key] for key in ours}


def _choice_logprobs(final: RequestOutput, c: CompletionOutput, req: CompletionRequest, i: int) -> dict[str, Any]:
    """A whole choice's logprobs, led by the echoed prompt's when `echo` is set."""
    ours = completion_logprobs(c, 0, req.num_logprobs or 0, len(req.echoes[i]))
    return _led_by_prompt(final, req, i, ours) if req.echo_logprobs else ours


def _answer(finals: list[RequestOutput], head: dict[str, Any], n: int, req: CompletionRequest) -> dict[str, Any]:
    """The whole text_completion object: choice `i * n + j` is choice j of prompt i."""
    choices = []
    for i, final in enumerate(finals):
        for c in final.outputs:
            choice = {
                "index": i * n + c.index, "text": req.echoes[i] + c.text,
                "logprobs": None if req.num_logprobs is None else _choice_logprobs(final, c, req, i),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(final)
            choices.append(choice)
    return {**head, "choices": choices, "usage": usage(finals)}


async def _chunks(outputs: AsyncIterator[tuple[int, RequestOutput]], head: dict[str, Any], n: int,
                  req: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
    """Stream chunks: text deltas per choice, a finish chunk per choice, usage.

    `text_offset` counts the token texts sent so far, as `_answer` does, not the text: with
    stop strings the engine holds the text's tail back, so the two differ mid-stream."""
    echoes, num_logprobs, include_usage = req.echoes, req.num_logprobs, req.include_usage
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    next_offset: dict[int, int] = {}  # text_offset of each choice's next token
    done: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    extra = {"usage": None} if include_usage else {}
    async for prompt_index, out in outputs:
        finals[prompt_index] = out
        for c in out.outputs:
            index = prompt_index * n + c.index
            if index in done:
                continue
            first = index not in sent_text
            delta = (echoes[prompt_index] if first else "") + c.text[sent_text.get(index, 0):]
            start = sent_tokens.get(index, 0)
            new_tokens = len(c.token_ids) > start
            if not delta and not c.finish_reason and not (num_logprobs is not None and new_tokens):
                continue
            logprobs = None
            if num_logprobs is not None:
                offset = next_offset.get(index, len(echoes[prompt_index]))
                logprobs = completion_logprobs(c, start, num_logprobs, offset)
                next_offset[index] = offset + sum(len(token) for token in logprobs["tokens"])
                if first and req.echo_logprobs:
                    logprobs = _led_by_prompt(out, req, prompt_index, logprobs)
            sent_text[index] = len(c.text)
            sent_tokens[index] = len(c.token_ids)
            if c.finish_reason:
                done.add(index)
            choice = {"index": index, "text": delta, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if first and req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out)
            yield {**head, "choices": [choice], **extra}
    if include_usage:
        yield {**head, "choices": [], "usage": usage([finals[i] for i in sorted(finals)])}
