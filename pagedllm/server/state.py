"""What the handlers share: the server's settings and the per-app state built from them.

Kept apart from the route table so that every endpoint module can import the state
type without importing the app (which imports them all). `ServerSettings` fields carry
the same metadata as the engine's config dataclasses, so `pagedllm serve --help` is
generated from both.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from starlette.requests import Request

from pagedllm.core.config import opt
from pagedllm.core.contracts.tools import ToolParser
from pagedllm.core.engine import AsyncLLMEngine, LLMEngine
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.reasoning import ReasoningParser, reasoning_parser_class
from pagedllm.server.shutdown import Lifecycle
from pagedllm.server.tools import resolve_tool_parser


@dataclass
class ServerSettings:
    """The HTTP server's options (the engine's are in `EngineConfig`)."""

    host: str = opt("127.0.0.1", "Address to listen on; 0.0.0.0 for every interface (vLLM's "
                    "choice when no host is given).", "server")
    port: int = opt(8000, "Port to listen on.", "server")
    api_key: str | None = opt(None, "Require 'Authorization: Bearer KEY' on /v1 routes "
                              "(default: env PAGEDLLM_API_KEY or VLLM_API_KEY; none).", "server")
    chat_template: str | None = opt(None, "Chat template: a file path or an inline Jinja string "
                                    "(default: the tokenizer's).", "server")
    reasoning_parser: str | None = opt(None, "Split the model's reasoning into reasoning_content: deepseek_r1, "
                                       "qwen3, granite, or one a plugin adds (default: off).", "server")
    enable_reasoning: bool = opt(False, "Deprecated vLLM spelling: --reasoning-parser alone enables "
                                 "reasoning.", "server")
    max_request_body_bytes: int = opt(16 << 20, "Largest request body accepted (413 beyond).", "server")
    allow_special_tokens_in_content: bool = opt(False, "Tokenize special-token strings inside chat messages "
                                                "as control tokens, as vLLM does (default: as plain text, so a "
                                                "user cannot forge turns such as a system message).", "server")
    enable_auto_tool_choice: bool = opt(False, "Let the model call tools on its own (tool_choice \"auto\", the "
                                        "default when a request gives tools); needs --tool-call-parser.", "server")
    tool_call_parser: str | None = opt(None, "How to read tool calls in the model's output: hermes, llama3_json, "
                                       "mistral, qwen3_xml (alias qwen3_coder), pythonic, or one from "
                                       "--tool-parser-plugin (default: none).", "server")
    tool_parser_plugin: str | None = opt(None, "A Python file loaded at start-up that defines more tool parsers: "
                                         "ToolParser subclasses with a `name`, or a @hookimpl "
                                         "pagedllm_tool_parsers() returning {name: class}.", "server")
    exclude_tools_when_tool_choice_none: bool = opt(False, "Leave the tools out of the prompt when a request's "
                                                    "tool_choice is \"none\" (default: they are rendered, as "
                                                    "vLLM does).", "server")
    api_server_count: int = opt(1, "vLLM's API server processes: accepted; one asyncio process serves every "
                                "engine replica here (a value above 1 is logged as such).", "server")
    uvicorn_log_level: str = opt("info", "Log level of uvicorn's access and error logs.", "server",
                                 choices=["critical", "error", "warning", "info", "debug", "trace"])
    header_timeout: float = opt(10.0, "Seconds a client has to send a request's line and headers, from "
                                "connecting or from the first byte of the next request on a kept-alive "
                                "connection (408 and close past it).", "server")
    body_timeout: float = opt(30.0, "Seconds a client has to send a request's whole body once its headers "
                              "are in (408 and close past it).", "server")
    keep_alive_timeout: float = opt(5.0, "Seconds an idle kept-alive connection stays open between "
                                    "requests.", "server")
    max_connections: int = opt(1024, "Most open connections; a request on one past it gets 503 and its "
                               "connection is closed.", "server")
    stream_stall_timeout: float = opt(60.0, "End a stream, aborting its request and freeing its KV cache, "
                                      "when its client has accepted no data for this many seconds "
                                      "(0: never).", "server")
    shutdown_timeout: float = opt(30.0, "On SIGTERM or SIGINT: seconds the requests in flight get to finish "
                                  "before they are ended with a 503 error; new requests get 503 "
                                  "meanwhile.", "server")

    def __post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {self.api_server_count}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "max_connections"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("stream_stall_timeout", "shutdown_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (e.g. hermes)")
        resolve_tool_parser(self.tool_call_parser, self.tool_parser_plugin)  # a bad name fails at start-up
        if self.reasoning_parser is not None:
            reasoning_parser_class(self.reasoning_parser)  # likewise


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: the contents of a file, or the value itself if it is inline Jinja."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither an existing file nor an inline Jinja template")


def model_as_given(llm_engine: LLMEngine) -> str:
    """The model as given on the command line (as vLLM reports it), else — the bundled
    default model — its file name: shorter to type than its path, and it does not tell
    clients where the server is installed."""
    return llm_engine.config.model.model or os.path.basename(llm_engine.model_path)


def served_model_names(engine: AsyncLLMEngine) -> list[str]:
    """`--served-model-name`, else the model as given (`model_as_given`)."""
    return [engine.engine.config.model.served_model_name or model_as_given(engine.engine)]


@dataclass
class ServerState:
    """What every handler needs, stored on `app.state.pagedllm`."""

    engine: AsyncLLMEngine
    settings: ServerSettings
    model_names: list[str]
    metrics: ServerMetrics
    chat_template: str | None
    reasoning: type[ReasoningParser] | None  # --reasoning-parser's class: one instance per choice
    created: int
    tool_parser: type[ToolParser] | None = None  # --tool-call-parser's class
    lifecycle: Lifecycle = field(default_factory=Lifecycle)

    @classmethod
    def create(cls, engine: AsyncLLMEngine, settings: ServerSettings) -> ServerState:
        """The state of an app serving `engine`; reads the chat template file (and the tool
        parser plugin) now, so a bad `--chat-template` fails at start-up rather than on the
        first chat request."""
        names = served_model_names(engine)
        return cls(engine=engine, settings=settings, model_names=names,
                   metrics=ServerMetrics(engine, names[0]),
                   chat_template=load_chat_template(settings.chat_template),
                   reasoning=reasoning_parser_class(settings.reasoning_parser) if settings.reasoning_parser
                   else None, created=int(time.time()),
                   tool_parser=resolve_tool_parser(settings.tool_call_parser, settings.tool_parser_plugin))

    @property
    def llm_engine(self) -> LLMEngine:
        """The synchronous LLMEngine behind `engine` (tokenizer, limits, stats); read-only
        from handlers, since its own thread drives it."""
        return self.engine.engine


def state_of(request: Request) -> ServerState:
    """The state of the app that received `request`."""
    return request.app.state.pagedllm
