"""The route table: every endpoint answers failures in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm.server.app import ROUTES
from pagedllm.server.errors import handle_errors
from pagedllm.server.metrics import ServerMetrics


def test_every_route_is_wrapped_in_handle_errors() -> None:
    async def endpoint(request: Any) -> Any:
        return None

    wrapper_code = handle_errors(endpoint).__code__
    for route in ROUTES:
        assert route.endpoint.__code__ is wrapper_code, route.path


def test_unexpected_error_in_an_info_route_is_an_openai_500(server, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected render fault")

    monkeypatch.setattr(ServerMetrics, "render", broken)
    with server.client() as http:
        response = http.get("/metrics")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "injected render fault" in error["message"]
