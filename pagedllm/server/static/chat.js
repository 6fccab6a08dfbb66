// pagedllm chat page: talks to this server's OpenAI API (/v1/models, /v1/chat/completions).
//
// Plain browser JavaScript, no build step and nothing fetched from elsewhere. Answers are
// streamed: the response body of fetch() is read as server-sent events. Stop aborts the
// fetch, which closes the connection, and the server then aborts the request (freeing its
// KV cache). All model text is put in the page with textContent, never as HTML.
"use strict";

const KEY_STORAGE = "pagedllm.apiKey";
const $ = (id) => document.getElementById(id);

const history = []; // the conversation so far: {role, content}, without the system prompt
let controller = null; // the AbortController of the answer being streamed, if any

class ServerError extends Error {}

function setStatus(text) {
  $("status").textContent = text;
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = false;
}

function hideError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

// The message of an OpenAI-shaped error body ({"error": {"message": ...}}), else the status.
async function errorMessage(response) {
  let message = `${response.status} ${response.statusText}`.trim();
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
  } catch (_) {
    // not JSON: keep the status line
  }
  if (response.status === 401) message += " (enter the server's API key in the API key field)";
  return message;
}

async function loadModels() {
  const select = $("model");
  setStatus("Loading models…");
  let response;
  try {
    response = await fetch("/v1/models", { headers: requestHeaders() });
  } catch (err) {
    setStatus("");
    showError(`Cannot reach the server: ${err.message}`);
    return;
  }
  if (!response.ok) {
    select.replaceChildren();
    setStatus("");
    showError(await errorMessage(response));
    return;
  }
  const body = await response.json();
  const previous = select.value;
  select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
  if (body.data.some((m) => m.id === previous)) select.value = previous;
  hideError();
  setStatus(`Ready: ${body.data.length} model${body.data.length === 1 ? "" : "s"}`);
}

// One message in the transcript; returns setters for its parts.
function addMessage(role, text) {
  const box = document.createElement("article");
  box.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  box.append(label, content);
  $("transcript").append(box);
  let reasoning = null;
  return {
    box,
    setContent(value) {
      content.textContent = value;
    },
    setReasoning(value) {
      if (reasoning === null) {
        const details = document.createElement("details");
        details.className = "reasoning";
        details.open = true;
        const summary = document.createElement("summary");
        summary.textContent = "Reasoning";
        reasoning = document.createElement("div");
        reasoning.className = "reasoning-text";
        details.append(summary, reasoning);
        box.insertBefore(details, content);
      }
      reasoning.textContent = value;
    },
    setMeta(value) {
      let meta = box.querySelector(".meta");
      if (!meta) {
        meta = document.createElement("div");
        meta.className = "meta";
        box.append(meta);
      }
      meta.textContent = value;
    },
  };
}

// Server-sent events of a fetch() body: yields each event's data (the server ends lines with "\n").
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.state = busy ? "streaming" : "idle";
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  hideError();
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history, { role: "user", content: text });
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    max_tokens: numberField("max-tokens"),
  };

  const question = addMessage("user", text);
  const answer = addMessage("assistant", "");
  answer.box.dataset.deltas = "0";
  $("prompt").value = "";
  controller = new AbortController();
  setBusy(true);
  setStatus("Generating…");
  const started = performance.now();
  let content = "";
  let reasoning = "";
  let usage = null;
  let finish = null;
  let deltas = 0;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: requestHeaders(),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new ServerError(await errorMessage(response));
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) {
          reasoning += delta.reasoning_content;
          answer.setReasoning(reasoning);
        }
        if (delta.content) {
          content += delta.content;
          answer.setContent(content);
          answer.box.dataset.deltas = String(++deltas);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    history.push({ role: "user", content: text }, { role: "assistant", content });
    const seconds = (performance.now() - started) / 1000;
    const tokens = usage ? usage.completion_tokens : deltas;
    answer.setMeta(`${tokens} tokens in ${seconds.toFixed(1)} s` + (finish === "length" ? " (max tokens reached)" : ""));
    answer.box.dataset.finish = finish || "";
    setStatus("Ready");
  } catch (err) {
    if (err.name === "AbortError") {
      // Stopped by the user: keep what arrived, as part of the conversation (unless "New chat"
      // stopped it: that conversation is gone).
      if (answer.box.isConnected) history.push({ role: "user", content: text }, { role: "assistant", content });
      answer.setMeta("stopped");
      answer.box.dataset.finish = "stopped";
      setStatus("Stopped");
    } else {
      // Failed: take the turn back and give the text back, so it can be sent again.
      question.box.remove();
      answer.box.remove();
      $("prompt").value = text;
      showError(err instanceof ServerError ? err.message : `Request failed: ${err.message}`);
      setStatus("");
    }
  } finally {
    controller = null;
    setBusy(false);
  }
}

function init() {
  const key = $("api-key");
  key.value = localStorage.getItem(KEY_STORAGE) || "";
  key.addEventListener("change", () => {
    const value = key.value.trim();
    if (value) localStorage.setItem(KEY_STORAGE, value);
    else localStorage.removeItem(KEY_STORAGE);
    loadModels();
  });
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    history.length = 0;
    $("transcript").replaceChildren();
    hideError();
  });
  setBusy(false);
  loadModels();
}

init();
