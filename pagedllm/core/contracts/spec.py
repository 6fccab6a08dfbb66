"""Speculative decoding: a proposer only proposes; the core verifies every proposal."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Sequence


class SpecProposer(ABC):
    """Proposes up to k draft tokens per request; the core verifies them in one target pass."""

    name: ClassVar[str]

    @abstractmethod
    def propose(self, token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """For each request's full token list, return at most k proposed next tokens."""
