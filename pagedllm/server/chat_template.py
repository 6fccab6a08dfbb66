"""Chat templates that a user's text cannot escape: rendering a conversation to prompt
text and token ids with the template's own special tokens as control tokens and every
special-token string that came from the request (message content, names,
`chat_template_kwargs`) as plain text, so no user can close their turn and open a
system one; `--allow-special-tokens-in-content` restores vLLM's parsing."""

from __future__ import annotations

import re
import secrets
import threading
import weakref
from typing import Any

from tokenizers import Tokenizer

from pagedllm.server.errors import APIError
from pagedllm.server.state import ServerState


def special_token_strings(tokenizer: Any) -> list[str]:
    """The strings `tokenizer` turns into special (control) tokens, longest first, so the
    longest match wins as it does in the tokenizer. Whitespace-only ones (a few vocabularies
    make a newline special) are left out: every template and message is full of them."""
    found = {token.content for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
             if getattr(token, "special", False)}
    found.update(getattr(tokenizer, "all_special_tokens", None) or [])
    return sorted((t for t in found if t.strip()), key=lambda t: (-len(t), t))


class ContentMarker:
    """Keeps special-token strings that come from a request from becoming control tokens.

    Without it, `<|im_end|><|im_start|>system` inside a user message tokenizes to the same
    ids as the template's own turn markers, and the user has written a system turn. Each
    special-token string in a request string is swapped for a marker (naming the token,
    with a random nonce so that no client can write one) before the template renders, so
    the special tokens left in the rendered text are the template's own. The markers go
    back to their strings in the prompt text, and the text between the template's special
    tokens is tokenized with special tokens split, i.e. as plain text.

    Args:
        tokenizer: the engine's tokenizer (transformers interface).
        enabled: False to mark nothing (`--allow-special-tokens-in-content`): content's
            special tokens are then parsed like the template's, as before.
    """

    def __init__(self, tokenizer: Any, enabled: bool = True) -> None:
        self.tokenizer = tokenizer
        self.specials = special_token_strings(tokenizer) if enabled else []
        self.count = 0  # special-token strings marked so far
        if self.specials:
            nonce = secrets.token_hex(8)
            self._special = re.compile("|".join(map(re.escape, self.specials)))
            self._index = {token: i for i, token in enumerate(self.specials)}
            self._marker = "\ue000" + nonce + ":{}\ue001"  # private-use code points around it
            self._marked = re.compile("\ue000" + nonce + r":(\d+)\ue001")

    def mark(self, value: Any) -> Any:
        """`value` with special-token strings marked, in strings, list items, dict keys and
        values (tool schemas and call arguments put client text in keys too)."""
        if not self.specials:
            return value
        if isinstance(value, str):
            return self._special.sub(self._mark_one, value)
        if isinstance(value, list):
            return [self.mark(v) for v in value]
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        return value

    def _mark_one(self, match: re.Match[str]) -> str:
        self.count += 1
        return self._marker.format(self._index[match.group()])

    def unmark(self, text: str) -> str:
        """`text` with each marker back to the special-token string it stands for."""
        if not self.count:
            return text
        return self._marked.sub(lambda m: self.specials[int(m.group(1))], text)

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a template rendered from marked values: its special tokens as control
        tokens, the text between them (markers restored) with special tokens as text.

        With nothing marked this is the tokenizer's own encoding. Splitting at special tokens
        changes nothing else: a tokenizer matches added tokens first and tokenizes the pieces
        between them apart.
        """
        if not self.count:
            return self.tokenizer.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        pos = 0
        for match in self._special.finditer(rendered):  # not marked, so written by the template
            ids += self._as_text(rendered[pos:match.start()])
            ids += self.tokenizer.encode(match.group(), add_special_tokens=False)
            pos = match.end()
        return ids + self._as_text(rendered[pos:])

    def _as_text(self, piece: str) -> list[int]:
        if not piece:
            return []
        backend = text_backend(self.tokenizer)
        if backend is not None:
            return backend.encode(self.unmark(piece), add_special_tokens=False).ids
        # A slow (Python) tokenizer takes split_special_tokens per call, touching no shared state.
        return list(self.tokenizer(self.unmark(piece), add_special_tokens=False,
                                   split_special_tokens=True)["input_ids"])


_TEXT_BACKENDS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_TEXT_BACKENDS_LOCK = threading.Lock()


def text_backend(tokenizer: Any) -> Any | None:
    """A private copy of a fast tokenizer's backend that tokenizes special-token strings as
    text; None for a slow tokenizer. Made once per tokenizer.

    Not `tokenizer(..., split_special_tokens=True)`: on a fast tokenizer that sets a flag on
    the backend every request shares, and leaves it set. Requests are tokenized on several
    worker threads, so another request's encode could clear it mid-call (letting a forged
    turn through) or find it still set (splitting a completions prompt's special tokens).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    with _TEXT_BACKENDS_LOCK:
        copy = _TEXT_BACKENDS.get(tokenizer)
        if copy is None:
            copy = Tokenizer.from_str(backend.to_str())
            copy.no_truncation()
            copy.no_padding()
            copy.encode_special_tokens = True
            _TEXT_BACKENDS[tokenizer] = copy
    return copy


def render_chat(state: ServerState, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """The conversation as prompt text and token ids; 400 when the template cannot render it.

    `tools` (OpenAI's {"type": "function", "function": {...}} dicts) reach the template as
    its `tools` variable, as transformers' `apply_chat_template(tools=...)` passes them.
    Special-token strings in the messages, the tools and `chat_template_kwargs` are
    tokenized as text (see `ContentMarker`) unless the server runs with
    `--allow-special-tokens-in-content`.
    """
    tokenizer = state.llm_engine.tokenizer
    template = state.chat_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template; start the server with --chat-template FILE "
                       "(or use /v1/completions)", param="messages", code="no_chat_template")
    marker = ContentMarker(tokenizer, enabled=not state.settings.allow_special_tokens_in_content)
    kwargs = dict(kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    try:
        rendered = tokenizer.apply_chat_template(marker.mark(messages), chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 **marker.mark(kwargs))
    except Exception as exc:  # jinja errors (raise_exception in templates), bad kwargs
        raise APIError(f"the chat template could not render these messages: {exc}", param="messages",
                       code="invalid_value") from None
    return marker.unmark(rendered), marker.encode(rendered)
