"""Times llama.cpp (llama-cpp-python, in .peers/llamacpp) on the GGUF itself.

`Llama.generate` handles one sequence at a time, which would make llama.cpp look
worse than it is under batch load. So this runner drives the C API directly: one
context with `n_seq_max` sequences, every prompt's tokens prefilled in shared
`llama_batch`es, then one batch per step holding the next token of every
sequence (greedy, EOS ignored). If the multi-sequence batch fails on this build,
it falls back to one sequence at a time and says so in `info["mode"]`.

The function names moved across llama.cpp versions (model load, context init,
KV-cache clear); `_first` picks whichever this build exports.
"""

from __future__ import annotations

from typing import Any

import _protocol


def _first(module: Any, *names: str) -> Any:
    for name in names:
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"llama_cpp has none of {names}")


class Engine:
    """A llama.cpp model and context sized for `n_seq` sequences of `max_len` tokens."""

    def __init__(self, job: dict) -> None:
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        load = _first(lc, "llama_model_load_from_file", "llama_load_model_from_file")
        self.model = load(job["model"].encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {job['model']}")
        self.max_len = int(job["max_len"])
        self.n_seq = max(1, min(int(job["n_ctx"]) // self.max_len, lc.llama_max_parallel_sequences()
                                if hasattr(lc, "llama_max_parallel_sequences") else 64))
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = self.n_seq * self.max_len
        cparams.n_batch = 2048
        cparams.n_ubatch = 512
        cparams.n_seq_max = self.n_seq
        cparams.n_threads = cparams.n_threads_batch = int(job["threads"])
        init = _first(lc, "llama_init_from_model", "llama_new_context_with_model")
        self.ctx = init(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        if hasattr(lc, "llama_model_get_vocab"):
            self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        else:
            self.n_vocab = lc.llama_n_vocab(self.model)
        self.batch = lc.llama_batch_init(cparams.n_batch, 0, 1)
        self.n_batch = cparams.n_batch
        self.batched_ok: bool | None = None
        self.threads = int(job["threads"])

    def clear(self) -> None:
        lc = self.lc
        if hasattr(lc, "llama_get_memory"):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        else:
            _first(lc, "llama_kv_self_clear", "llama_kv_cache_clear")(self.ctx)

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """Decode (token, pos, seq, want_logits) entries in n_batch-sized pieces; returns
        {seq: greedy next token} for the entries that asked for logits."""
        out: dict[int, int] = {}
        b = self.batch
        for start in range(0, len(entries), self.n_batch):
            piece = entries[start:start + self.n_batch]
            for i, (tok, pos, seq, logits) in enumerate(piece):
                b.token[i] = tok
                b.pos[i] = pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = logits
            b.n_tokens = len(piece)
            rc = self.lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for i, (_, _, seq, logits) in enumerate(piece):
                if logits:
                    out[seq] = self._argmax(i)
        return out

    def generate_group(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        """Up to n_seq prompts decoded together; each gets exactly max_tokens tokens."""
        self.clear()
        entries = [(tok, pos, seq, pos == len(p) - 1)
                   for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
        nxt = self._decode(entries)
        pos = [len(p) for p in prompts]
        for _ in range(max_tokens - 1):
            nxt = self._decode([(nxt[s], pos[s], s, True) for s in range(len(prompts))])
            pos = [q + 1 for q in pos]
        return [max_tokens] * len(prompts)


def load(job: dict) -> tuple[Any, dict]:
    import llama_cpp

    engine = Engine(job)
    info = {"version": llama_cpp.__version__, "model": job["model"], "dtype": "GGUF weights (as stored)",
            "threads": engine.threads, "mode": f"multi-sequence llama_batch, up to {engine.n_seq} sequences"}
    engine.info = info  # type: ignore[attr-defined]
    return engine, info


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[int]:
    counts: list[int] = []
    if len(prompts) > 1 and engine.batched_ok is not False:
        try:
            for i in range(0, len(prompts), engine.n_seq):
                counts += engine.generate_group(prompts[i:i + engine.n_seq], max_tokens)
            engine.batched_ok = True
            return counts
        except RuntimeError as exc:
            engine.batched_ok = False
            engine.info["mode"] = f"sequential (the multi-sequence batch failed: {exc})"  # type: ignore[attr-defined]
            counts = []
    for p in prompts:
        counts += engine.generate_group([p], max_tokens)
    return counts


if __name__ == "__main__":
    _protocol.run(load, generate)
