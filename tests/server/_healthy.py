"""Test helper: after abuse, the server must still be up and still answer."""

from __future__ import annotations

from typing import Any


def assert_healthy(live: Any) -> None:
    """`GET /health` is 200 and a small completion is answered (fails the test otherwise)."""
    with live.client() as http:
        assert http.get("/health").status_code == 200
        response = http.post("/v1/completions", json={"model": live.model, "prompt": "Hello", "max_tokens": 2,
                                                      "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1
