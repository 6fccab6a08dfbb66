"""pagedllm's log set-up, shared by the LLM API and the CLI (once per process)."""

from __future__ import annotations

import logging
import sys
from typing import Any

FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (test runners swap it after set-up)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_logging() -> None:
    """Log pagedllm's records to stderr at PAGEDLLM_LOGGING_LEVEL (default INFO)."""
    from pagedllm.core import envs

    logger = logging.getLogger("pagedllm")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel((envs.get("PAGEDLLM_LOGGING_LEVEL") or "INFO").upper())
