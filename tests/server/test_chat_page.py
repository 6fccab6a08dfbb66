"""The browser chat page at GET /, in headless Chromium against a live `pagedllm serve`.

Chromium is driven over the Chrome DevTools Protocol on a websocket (websocket-client):
text is typed with Input.insertText and sent with a real Enter key event, and the answer is
read from the DOM. The main server runs the bundled SmolLM2 with an API key, so the page
first meets a 401 and must ask for the key; a second server (tiny model, no key) runs a
reasoning parser, whose output the page must show apart from the answer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import websocket

from tests._uvicorn import wait_healthy

pytestmark = pytest.mark.slow

API_KEY = "page-key"
CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
if CHROMIUM is None:
    pytest.skip("Chromium not found (Debian: apt-get install chromium)", allow_module_level=True)

ANSWER = "#transcript .message.assistant:last-child"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(*args: str) -> Iterator[str]:
    """`pagedllm serve ARGS` in a subprocess on a free port; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", *args, "--port", str(port),
                             "--uvicorn-log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol."""

    def __init__(self, profile: Path) -> None:
        self.log = open(profile.parent / "chromium.log", "wb")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=self.log, stderr=subprocess.STDOUT)
        port_file = profile / "DevToolsActivePort"  # Chromium writes its port here once listening
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                pytest.fail(f"Chromium did not start; see {self.log.name}")
            time.sleep(0.05)
        port = port_file.read_text().split()[0]
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events that arrive meanwhile are dropped)."""
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message["result"]

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                page = self.eval("JSON.stringify({status: document.getElementById('status').textContent, "
                                 "error: document.getElementById('error').textContent})")
                raise AssertionError(f"timed out waiting for {expression!r}; page: {page}")
            time.sleep(0.05)

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && document.body.dataset.state === 'idle'")

    def type_into(self, element_id: str, text: str) -> None:
        """Replace a field's text as a user would: focus, select all, type."""
        self.eval(f"(e => {{ e.focus(); e.select(); }})(document.getElementById({json.dumps(element_id)}))")
        self.call("Input.insertText", text=text)

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)

    def text(self, selector: str) -> str:
        return self.eval(f"(document.querySelector({json.dumps(selector)}) || {{}}).textContent ?? ''")

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    b = Browser(tmp_path_factory.mktemp("chromium") / "profile")
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The default model (bundled SmolLM2) behind an API key (128M: room for 2048 tokens in a
    float32 cache, what a CPU without native bf16 keeps)."""
    with serve("--api-key", API_KEY, "--kv-cache-memory", "128M", "--max-model-len", "2048") as url:
        yield url


def api_answer(url: str, messages: list[dict[str, str]], max_tokens: int, key: str | None = API_KEY) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60,
                          json={"messages": messages, "temperature": 0, "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def open_with_key(browser: Browser, url: str) -> None:
    browser.open(url)
    browser.eval(f"localStorage.setItem('pagedllm.apiKey', {json.dumps(API_KEY)})")
    browser.open(url)
    browser.wait_for("document.getElementById('model').options.length > 0")


def ask(browser: Browser, text: str, temperature: str = "0", max_tokens: str = "48") -> None:
    browser.type_into("temperature", temperature)
    browser.type_into("max-tokens", max_tokens)
    browser.type_into("prompt", text)
    browser.press_enter()


def test_the_page_needs_no_key_and_asks_for_one(server: str, browser: Browser) -> None:
    page = httpx.get(server + "/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text), "the page must load nothing from elsewhere"
    for asset in ("chat.js", "chat.css"):
        assert httpx.get(f"{server}/static/{asset}", timeout=10).status_code == 200
    assert httpx.get(server + "/v1/models", timeout=10).status_code == 401

    browser.open(server)
    browser.eval("localStorage.clear()")
    browser.open(server)
    assert "401" in browser.wait_for("!document.getElementById('error').hidden && "
                                     "document.getElementById('error').textContent")
    assert browser.eval("document.getElementById('model').options.length") == 0
    ask(browser, "Hello there")
    browser.wait_for("document.getElementById('error').textContent.includes('invalid_api_key') || "
                     "document.getElementById('error').textContent.includes('API key')")
    assert browser.eval("document.getElementById('prompt').value") == "Hello there", "a failed turn gives its text back"
    assert browser.eval("document.querySelectorAll('#transcript .message').length") == 0

    browser.type_into("api-key", API_KEY)
    browser.eval("document.getElementById('prompt').focus()")  # leaving the field commits it ("change")
    models = httpx.get(server + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()
    assert browser.wait_for("document.getElementById('model').options.length > 0 && "
                            "document.getElementById('model').value") == models["data"][0]["id"]
    assert browser.eval("document.getElementById('error').hidden") is True
    assert browser.eval("localStorage.getItem('pagedllm.apiKey')") == API_KEY
    browser.open(server)  # the key is remembered
    assert browser.eval("document.getElementById('api-key').value") == API_KEY
    browser.wait_for("document.getElementById('model').options.length > 0")


def test_streamed_answer_is_the_apis_greedy_answer(server: str, browser: Browser) -> None:
    open_with_key(browser, server)
    # Record the answer's length at each change of the page, while it streams.
    browser.eval("""window.seen = []; new MutationObserver(() => {
        const box = document.querySelector('#transcript .message.assistant:last-child .content');
        if (box) window.seen.push([box.textContent.length, document.body.dataset.state]);
    }).observe(document.getElementById('transcript'), {subtree: true, childList: true, characterData: true})""")
    question = "What is the capital of France? Answer in two sentences."
    ask(browser, question, max_tokens="40")
    browser.wait_for(f"document.querySelector('{ANSWER}')?.dataset.finish")
    answer = browser.text(f"{ANSWER} .content")
    expected = api_answer(server, [{"role": "user", "content": question}], 40)["content"]
    assert answer and answer == expected
    assert browser.text("#transcript .message.user .content") == question
    lengths = {n for n, state in browser.eval("window.seen") if state == "streaming" and 0 < n < len(answer)}
    assert len(lengths) >= 2, f"the answer should grow while it streams; saw lengths {sorted(lengths)}"
    assert int(browser.eval(f"document.querySelector('{ANSWER}').dataset.deltas")) >= 2
    assert "tokens" in browser.text(f"{ANSWER} .meta")
    assert browser.eval("document.getElementById('send').disabled") is False


def test_second_turn_carries_the_system_prompt_and_history(server: str, browser: Browser) -> None:
    open_with_key(browser, server)
    system = "You are a terse assistant. Reply in one short sentence."
    browser.type_into("system-prompt", system)
    history = [{"role": "system", "content": system}]
    for question in ("Name a large animal.", "Where does it live?"):
        before = browser.eval("document.querySelectorAll('#transcript .message.assistant').length")
        ask(browser, question, max_tokens="24")
        browser.wait_for(f"document.querySelectorAll('#transcript .message.assistant').length > {before} && "
                         f"document.querySelector('{ANSWER}').dataset.finish")
        history.append({"role": "user", "content": question})
        expected = api_answer(server, history, 24)["content"]
        assert browser.text(f"{ANSWER} .content") == expected
        history.append({"role": "assistant", "content": expected})
    browser.eval("document.getElementById('clear').click()")
    assert browser.eval("document.querySelectorAll('#transcript .message').length") == 0


def aborted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pagedllm:request_success_total") and 'finished_reason="abort"' in line)


def running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(next(x for x in text.splitlines() if x.startswith("pagedllm:num_requests_running")).split()[-1])


def test_stop_ends_the_stream_and_the_server_aborts_the_request(server: str, browser: Browser) -> None:
    open_with_key(browser, server)
    before = aborted(server)
    ask(browser, "Write a very long story about a dragon and a knight.", temperature="0.8", max_tokens="1500")
    browser.wait_for(f"Number(document.querySelector('{ANSWER}')?.dataset.deltas) >= 3")
    browser.eval("document.getElementById('stop').click()")
    browser.wait_for(f"document.querySelector('{ANSWER}').dataset.finish === 'stopped'", timeout=10)
    assert browser.text(f"{ANSWER} .meta") == "stopped"
    assert browser.eval("document.getElementById('stop').disabled") is True
    deadline = time.monotonic() + 15
    while running(server) > 0 or aborted(server) <= before:
        assert time.monotonic() < deadline, "the server should abort the stopped request"
        time.sleep(0.1)
    kept = browser.text(f"{ANSWER} .content")
    time.sleep(0.5)
    assert kept and browser.text(f"{ANSWER} .content") == kept, "nothing arrives after Stop"


def test_a_refused_request_shows_the_servers_error_message(server: str, browser: Browser) -> None:
    open_with_key(browser, server)
    ask(browser, "Hi", max_tokens="100000")
    error = browser.wait_for("!document.getElementById('error').hidden && document.getElementById('error').textContent")
    assert error.startswith("400") and "maximum context length is 2048 tokens" in error
    assert browser.eval("document.getElementById('prompt').value") == "Hi"


def test_reasoning_is_shown_apart_from_the_answer(tiny_model_dir: Any, browser: Browser) -> None:
    """With --reasoning-parser, text before </think> is reasoning; the random tiny model never
    writes the tag, so its whole answer is reasoning and the answer proper is empty."""
    model = str(tiny_model_dir("llama"))
    with serve(model, "--served-model-name", "tiny", "--kv-cache-memory", "8M",
               "--reasoning-parser", "deepseek_r1") as url:
        browser.open(url)
        browser.eval("localStorage.clear()")
        browser.open(url)
        browser.wait_for("document.getElementById('model').value === 'tiny'")
        ask(browser, "Hello", max_tokens="12")
        browser.wait_for(f"document.querySelector('{ANSWER}')?.dataset.finish")
        expected = api_answer(url, [{"role": "user", "content": "Hello"}], 12, key=None)
    assert expected["reasoning_content"] and not expected["content"]
    assert browser.text(f"{ANSWER} .reasoning-text") == expected["reasoning_content"]
    assert browser.text(f"{ANSWER} .reasoning summary") == "Reasoning"
    assert browser.text(f"{ANSWER} .content") == ""
