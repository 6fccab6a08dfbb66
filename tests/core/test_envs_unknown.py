"""Environment variables that do nothing must not pass unnoticed: a typo of a known
PAGEDLLM_* / VLLM_* name gets vLLM's "unknown environment variable" warning, a vLLM
variable with no effect here says why, known ones and other prefixes stay quiet."""

from __future__ import annotations

import logging

from pagedllm.core import envs


def test_unknown_and_ineffective_variables_are_named(caplog) -> None:
    environ = {"VLLM_ATTENTION_BACKNED": "TORCH", "VLLM_MEDIA_LOADING_THREAD_COUNT": "8",
               "VLLM_ATTENTION_BACKEND": "TORCH", "PAGEDLLM_PLUGINS": "models", "HOME": "/root",
               "PAGEDLLM_CPU_KVCACHE_SPAC": "4"}
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        messages = envs.warn_environment(environ)
    assert len(messages) == 3, messages
    assert "unknown environment variable VLLM_ATTENTION_BACKNED" in messages[1]
    assert "unknown environment variable PAGEDLLM_CPU_KVCACHE_SPAC" in messages[0]
    assert messages[2].startswith("VLLM_MEDIA_LOADING_THREAD_COUNT is set and has no effect here")
    assert [r.message for r in caplog.records] == messages
    assert envs.warn_environment({"VLLM_USE_V1": "1", "PAGEDLLM_API_KEY": "x"}) == []
    # the test suite's own settings (tests/conftest.py) are not typos
    assert envs.warn_environment({"PAGEDLLM_TEST_DEVICE": "cuda", "PAGEDLLM_TEST_REPORT": "/tmp/f"}) == []
