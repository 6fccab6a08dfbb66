"""`pagedllm chat`: a terminal conversation with a model (the bundled SmolLM2 by default).

Each turn applies the model's chat template to the whole conversation, queues one
request on the engine and prints the text as `LLMEngine.step()` produces it (the
engine's outputs carry the cumulative text; we print what is new). Ctrl-C stops the
current answer (the partial answer stays in the history); Ctrl-D or /exit leaves.
Commands: /exit, /reset (forget the conversation), /system TEXT (set the system prompt).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, TextIO

from pagedllm.core.request import SamplingParams
from pagedllm.engine_args import engine_kwargs_from_args

HELP = "commands: /exit, /reset, /system TEXT   (Ctrl-C stops an answer, Ctrl-D quits)"
DEFAULT_MAX_TOKENS = 512


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """Chat sampling from `args.temperature`, `args.top_p`, `args.max_tokens` (each
    optional). Reproducibility comes from the engine's `--seed`, not a per-turn seed,
    so two turns do not replay one random stream."""
    def pick(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    return SamplingParams(temperature=pick("temperature", 0.7), top_p=pick("top_p", 1.0),
                          max_tokens=pick("max_tokens", DEFAULT_MAX_TOKENS))


class ChatSession:
    """A conversation over one engine: history, templating and streaming of one turn."""

    def __init__(self, llm: Any, params: SamplingParams, system: str | None = None) -> None:
        self.llm = llm
        self.params = params
        self.system = system
        self.history: list[dict[str, str]] = []

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    def reply(self, user_text: str, write: Callable[[str], Any]) -> str:
        """Add the user's message, stream the answer through `write`, return it.

        A KeyboardInterrupt aborts the request; what was written so far is kept."""
        self.history.append({"role": "user", "content": user_text})
        engine = self.llm.engine
        prompt_ids = self.llm.apply_chat_template(self.messages())
        request_id = engine.add_request(None, None, self.params, prompt_token_ids=prompt_ids)
        shown = ""
        try:
            finished = False
            while not finished:
                for out in engine.step():
                    if out.request_id != request_id:
                        continue
                    text = out.outputs[0].text
                    if text.startswith(shown) and len(text) > len(shown):
                        write(text[len(shown):])
                        shown = text
                    finished = out.finished
        except KeyboardInterrupt:
            engine.abort(request_id)
            write(" [stopped]")
        self.history.append({"role": "assistant", "content": shown})
        return shown


def run_chat(args: argparse.Namespace, *, llm: Any = None, input_fn: Callable[[str], str] = input,
             out: TextIO | None = None) -> int:
    """Run the interactive chat; returns the exit status.

    `args`: `model` (path or None for the default); the engine arguments as
    `engine_kwargs` (what `pagedllm chat` passes) or as attributes by their vLLM names
    (dtype, max_model_len, kv_cache_memory, ...) plus `plugin_options`; and the chat's own
    `system`, `temperature`, `top_p`, `max_tokens`. All optional. `llm`,
    `input_fn` and `out` exist for tests (an `LLM` to reuse, scripted input, a buffer).
    """
    out = out or sys.stdout
    if llm is None:
        from pagedllm.llm import LLM

        kwargs = getattr(args, "engine_kwargs", None)  # `pagedllm chat` validated them already
        if kwargs is None:
            kwargs = engine_kwargs_from_args(args)
        llm = LLM(getattr(args, "model", None), **{k: v for k, v in kwargs.items() if k != "model"})
    session = ChatSession(llm, sampling_params(args), getattr(args, "system", None))

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    write(f"chatting with {llm.engine.model_path}\n{HELP}\n")
    while True:
        try:
            line = input_fn("\n> ").strip()
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return 0
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            session.history.clear()
            write("(conversation cleared)\n")
            continue
        if line.startswith("/system"):
            session.system = line[len("/system"):].strip() or None
            write(f"(system prompt {'set' if session.system else 'cleared'})\n")
            continue
        if line.startswith("/"):
            write(f"unknown command {line.split()[0]!r}; {HELP}\n")
            continue
        session.reply(line, write)
        write("\n")
