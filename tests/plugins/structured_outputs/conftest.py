"""Shared pieces of the structured-outputs tests: the bundled SmolLM2 (one engine per
module), chat prompts, and a check that an output is JSON valid under its schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pagedllm import LLM

LLM_ARGS = dict(kv_cache_memory=256 << 20, max_model_len=2048)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The default engine (backend "auto")."""
    return LLM(**LLM_ARGS)


def chat_prompt(llm: LLM, text: str) -> dict[str, Any]:
    return {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": text}])}


def assert_valid_json(text: str, schema: dict, where: str = "") -> Any:
    """The parsed output, after checking it is JSON that satisfies `schema`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{where}: not JSON ({exc}): {text!r}") from None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        raise AssertionError(f"{where}: breaks the schema ({exc.message}): {text!r}") from None
    return value
