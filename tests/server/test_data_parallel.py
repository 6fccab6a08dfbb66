"""`--data-parallel-size 2`: two engine replicas behind one server. Concurrent requests are
spread over both, each answered exactly as one engine answers it, /metrics reports each
replica under its `engine` label, and bad input still gets its 400."""

from __future__ import annotations

import concurrent.futures

from tests.server.conftest import MODEL_NAME

PROMPTS = ["the cat", "a dog ran", "one two three", "hello there", "blue sky", "x y z"]


def complete(live, prompt: str) -> str:
    with live.client() as http:
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24,
                                               "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_replicas_share_the_load_and_answer_as_one_engine(start_server):
    with start_server() as one:
        expected = [complete(one, p) for p in PROMPTS]
    with start_server(data_parallel_size=2) as live:
        engines = live.engine.engines
        assert len(engines) == 2 and engines[0] is not engines[1]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: complete(live, p), PROMPTS))
        assert got == expected, "a replica answered differently from a single engine"
        assert all(e.stats.num_generation_tokens > 0 for e in engines), \
            f"one replica did all the work: {[e.stats.num_generation_tokens for e in engines]}"
        with live.client() as http:
            metrics = http.get("/metrics").text
            assert 'engine="1"' in metrics and 'engine="0"' in metrics
            bad = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1})
            assert bad.status_code == 400 and bad.json()["error"]["message"]
            assert http.get("/health").status_code == 200
