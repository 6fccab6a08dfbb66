"""Standalone scripts that time one engine for `pagedllm bench compare`.

Each runs in its engine's own interpreter (a peer's venv under .peers/, where
pagedllm is not installed), so a runner imports only the standard library, its
engine and `_protocol` (found beside it on sys.path, as a script's folder is).
They are run by path, never imported: `python runners/vllm_runner.py JOB RESULT`.
"""
