"""Hub model names (`Qwen/Qwen3-8B`) to local directories, the way Hugging Face tools do.

A name that is not a local path and looks like ORG/NAME is looked up in the local
Hugging Face cache first (`--download-dir`, else HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub; the snapshot `--revision` names, `main` by default), then
downloaded with huggingface_hub when the hub is reachable (HF_TOKEN for gated models,
HF_ENDPOINT for a mirror, its progress bars). With HF_HUB_OFFLINE=1, or when the hub
cannot be reached, the error says how to get the files. Only what the engine reads is
fetched: configs, tokenizer files, chat templates and safetensors weights.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger("pagedllm")

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what the engine reads from a repository (never .bin / .pt / .gguf duplicates of the weights)
WANTED_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def looks_like_hub_name(name: str) -> bool:
    return bool(HUB_NAME.match(name)) and not os.path.exists(name)


def cache_dir(download_dir: str | None = None) -> str:
    """Where Hugging Face tools keep downloaded repositories (read from the environment
    now, not when huggingface_hub was imported)."""
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model(name: str, revision: str | None = None, download_dir: str | None = None,
                  what: str = "model") -> str:
    """A local path for `name`: itself when it exists, else its snapshot in the cache,
    else (online) a fresh download. A ValueError says what to do otherwise."""
    if os.path.exists(name):
        return name
    if not HUB_NAME.match(name):
        raise ValueError(f"{what} path {name!r} does not exist; give a local directory or .gguf file, or a Hugging "
                         "Face repository name such as Qwen/Qwen3-8B")
    from huggingface_hub import snapshot_download

    cache = cache_dir(download_dir)
    ref = revision or "main"
    try:
        path = snapshot_download(name, revision=revision, cache_dir=cache, local_files_only=True,
                                 allow_patterns=WANTED_FILES)
        logger.info("%s %s (%s): from the local cache %s", what, name, ref, path)
        return path
    except Exception:  # noqa: BLE001 - not in the cache (huggingface_hub's errors vary by version)
        pass
    how = (f"download it where the hub is reachable (`hf download {name}"
           f"{' --revision ' + revision if revision else ''}`, with HF_HUB_CACHE={cache} or --download-dir), "
           "or pass a local directory")
    if offline():
        raise ValueError(f"{what} {name!r} (revision {ref}) is not in the Hugging Face cache {cache}, and "
                         f"HF_HUB_OFFLINE is set: {how}")
    logger.info("%s %s (%s): not in the cache %s; downloading", what, name, ref, cache)
    try:
        return snapshot_download(name, revision=revision, cache_dir=cache, allow_patterns=WANTED_FILES)
    except Exception as exc:  # noqa: BLE001 - network, auth and not-found errors all end here
        hint = " (a gated or private repository needs HF_TOKEN)" if "401" in str(exc) or "403" in str(exc) else ""
        raise ValueError(f"{what} {name!r} (revision {ref}) could not be downloaded{hint}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; {how}") from None
