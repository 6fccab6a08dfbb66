"""Hub model names: a Hugging Face cache built here in the real layout (blobs, snapshots,
refs) serves `acme/tiny` by name with HF_HUB_OFFLINE=1; --revision picks another
snapshot; a name in no cache, offline, gets an error saying how to get the files."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.hub import resolve_model


def add_snapshot(cache: Path, repo: str, source: Path, ref: str, commit: str) -> Path:
    """Copy `source`'s files into `cache` as huggingface_hub lays a download out: each file a
    blob named by its hash, the snapshot a folder of symlinks to them, the ref a file
    holding the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, tiny_model_dir, monkeypatch):
    cache = tmp_path / "hub"
    main = add_snapshot(cache, "acme/tiny", tiny_model_dir("llama"), "main", "a" * 40)
    v1 = add_snapshot(cache, "acme/tiny", tiny_model_dir("qwen2"), "v1", "b" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache, main, v1


def test_served_by_name_from_the_cache_offline(hub_cache, tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_name = LLM("acme/tiny", dtype="float32", device="cpu", kv_cache_memory=1 << 22)
    by_path = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", kv_cache_memory=1 << 22)
    assert by_name.engine.config.model.model == "acme/tiny", "the model is reported as given"
    got = by_name.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == by_path.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids


def test_revision_and_download_dir_pick_the_snapshot(hub_cache, monkeypatch):
    cache, main, v1 = hub_cache
    assert Path(resolve_model("acme/tiny")) == main
    assert Path(resolve_model("acme/tiny", revision="v1")) == v1
    monkeypatch.delenv("HF_HUB_CACHE")
    moved = cache.parent / "elsewhere"
    shutil.move(cache, moved)
    assert Path(resolve_model("acme/tiny", download_dir=str(moved))).name == "a" * 40


def test_unknown_name_offline_says_how_to_get_it(hub_cache):
    with pytest.raises(ValueError, match=r"not in the Hugging Face cache .*HF_HUB_OFFLINE.*hf download acme/missing"):
        LLM("acme/missing", device="cpu")
    with pytest.raises(ValueError, match="revision nope"):
        resolve_model("acme/tiny", revision="nope")


def test_a_missing_local_path_is_not_taken_for_a_hub_name(tmp_path):
    with pytest.raises(ValueError, match="does not exist; give a local directory"):
        resolve_model(str(tmp_path / "no" / "such" / "dir"))
