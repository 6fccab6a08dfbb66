"""A server with speculative decoding: streamed and non-streamed completions equal the
output without speculation, usage counts what was returned, and /metrics reports the
drafts under vLLM's names."""

from __future__ import annotations

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def test_streams_and_metrics_with_a_draft_model(start_server, server_model_path) -> None:
    spec = {"model": server_model_path, "num_speculative_tokens": 3, "adaptive": False}
    request = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.0, logprobs=1)
    with start_server() as plain, plain.openai() as client:
        want = client.completions.create(**request)
    with start_server(speculative_config=spec) as live, live.openai() as client:
        got = client.completions.create(**request)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
        assert got.usage.completion_tokens == want.usage.completion_tokens == 20
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **request)
                           if chunk.choices)
        assert streamed == want.choices[0].text
        with live.client() as http:
            text = http.get("/metrics").text
        for name in ["spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                     "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total"]:
            assert f"pagedllm:{name}" in text, name
        accepted = next(line for line in text.splitlines()
                        if line.startswith("pagedllm:spec_decode_num_accepted_tokens_total"))
        assert float(accepted.split()[-1]) == live.engine.engine.scheduler.spec_stats.num_accepted_tokens > 0
