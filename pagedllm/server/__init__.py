"""The OpenAI-compatible HTTP server (`pagedllm serve`); see `app.build_app`."""
