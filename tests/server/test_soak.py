"""A bounded soak of the server: mixed clients for a fixed time, then a clean engine.

Eight client threads loop for SOAK_SECONDS over a random mix: whole completions and
chats, streams read to the end, streams dropped after a few events, slow readers,
oversized bodies and malformed JSON. Afterwards: no 5xx was seen, every accepted
request ended, the engine holds no request and owns no KV block, the server still
answers, and the process's resident memory grew by less than RSS_BOUND_MIB.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import httpx

from pagedllm.server.app import ServerSettings

SOAK_SECONDS = 30.0
NUM_CLIENTS = 8
MAX_BODY = 64 << 10
RSS_BOUND_MIB = 128


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def completion_body(rng: random.Random, stream: bool) -> dict:
    return {"model": "tiny", "prompt": [rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))],
            "max_tokens": rng.randrange(1, 24), "temperature": rng.choice([0.0, 0.8]), "stream": stream,
            "ignore_eos": True}


def one_action(client: httpx.Client, rng: random.Random) -> str:
    """Run one random client behaviour; returns its label and the status it saw."""
    kind = rng.choice(["whole", "chat", "stream", "drop", "slow", "oversized", "malformed"])
    if kind == "whole":
        r = client.post("/v1/completions", json=completion_body(rng, False))
        return f"{kind}:{r.status_code}"
    if kind == "chat":
        r = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello " * rng.randrange(1, 10)}],
            "max_tokens": rng.randrange(1, 16)})
        return f"{kind}:{r.status_code}"
    if kind == "oversized":
        r = client.post("/v1/completions", content=b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}',
                        headers={"Content-Type": "application/json"})
        return f"{kind}:{r.status_code}"
    if kind == "malformed":
        r = client.post("/v1/completions", content=b'{"prompt": [1, 2,', headers={"Content-Type": "application/json"})
        return f"{kind}:{r.status_code}"
    # streams: read to the end, drop after a few events, or read slowly then drop
    with client.stream("POST", "/v1/completions", json=completion_body(rng, True)) as r:
        if r.status_code != 200:
            return f"{kind}:{r.status_code}"
        keep = {"stream": 10 ** 9, "drop": rng.randrange(1, 4), "slow": rng.randrange(2, 5)}[kind]
        events = 0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return f"{kind}:done"
            if "error" in json.loads(line[6:]):
                return f"{kind}:error-event"
            events += 1
            if kind == "slow":
                time.sleep(0.2)
            if events >= keep:
                return f"{kind}:left"
        return f"{kind}:no-done"


def test_mixed_abuse_leaves_a_clean_engine(start_server):
    settings = ServerSettings(max_request_body_bytes=MAX_BODY)
    with start_server(settings, max_num_seqs=16) as live:
        with live.client() as warm:  # first requests build caches; measure memory after them
            assert warm.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}) \
                .status_code == 200
        live.wait_idle()
        rss_before = rss_mib()
        seen: Counter = Counter()
        lock = threading.Lock()
        deadline = time.monotonic() + SOAK_SECONDS

        def client_loop(seed: int) -> None:
            rng = random.Random(seed)
            with live.client(timeout=60) as client:
                while time.monotonic() < deadline:
                    outcome = one_action(client, rng)
                    with lock:
                        seen[outcome] += 1

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(NUM_CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=SOAK_SECONDS + 120)
        assert not any(t.is_alive() for t in threads), "a client thread hung"

        server_errors = {k: v for k, v in seen.items() if k.split(":")[1].startswith("5")}
        assert not server_errors, f"5xx answers during the soak: {server_errors} (all: {dict(seen)})"
        assert seen["oversized:413"] and not any(k.startswith("oversized:") and k != "oversized:413" for k in seen), \
            dict(seen)
        assert not any(k.startswith("malformed:") and k != "malformed:400" for k in seen), dict(seen)
        bad_streams = {k: v for k, v in seen.items() if k.endswith(("no-done", "error-event"))}
        assert not bad_streams, f"streams that ended without [DONE]: {bad_streams}"
        assert sum(seen.values()) >= NUM_CLIENTS * 5, f"too little traffic to call this a soak: {dict(seen)}"

        live.wait_idle(timeout=30)
        core = live.engine.engine
        assert core.block_manager.usage == 0.0, f"{core.block_manager.usage:.1%} of the KV blocks still owned"
        with live.client() as after:
            assert after.get("/health").status_code == 200
            r = after.post("/v1/completions", json={"model": "tiny", "prompt": "still there?", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        growth = rss_mib() - rss_before
        assert growth < RSS_BOUND_MIB, f"resident memory grew by {growth:.0f} MiB during the soak"
