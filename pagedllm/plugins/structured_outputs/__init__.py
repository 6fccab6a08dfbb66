"""Structured outputs (JSON schema, regex, choice, grammar) as a logits-processor plugin."""

from __future__ import annotations

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_logits_processors():
    return {}
