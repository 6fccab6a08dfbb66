"""LLM: the offline API, with vLLM's names (`generate`, `chat`), over `LLMEngine`."""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

from pagedllm.core.config import EngineConfig
from pagedllm.core.engine import LLMEngine
from pagedllm.core.logs import setup_logging
from pagedllm.core.request import RequestOutput, SamplingParams

PromptType = str | dict[str, Any]

logger = logging.getLogger("pagedllm")


class LLM:
    """An engine for offline batched generation.

    Args:
        model: a Hugging Face model directory or a .gguf file; None uses the bundled
            SmolLM2-135M-Instruct GGUF.
        **kwargs: vLLM engine arguments (tokenizer, dtype, max_model_len, max_num_seqs,
            max_num_batched_tokens, block_size, enable_prefix_caching,
            enable_chunked_prefill, gpu_memory_utilization, kv_cache_memory, seed,
            enforce_eager, trust_remote_code, attention_backend, device,
            quantization, load_format, kv_cache_dtype, hf_overrides={...} merged into
            the Hugging Face config, rope_scaling={...} / rope_theta= (vLLM's older
            spellings of hf_overrides), ...). Plugin-added options go in
            `plugin_options={...}`.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        setup_logging()
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        if self.config.parallel.data_parallel_size > 1:
            raise NotImplementedError("data_parallel_size > 1 is for `pagedllm serve` (replicas behind one server); "
                                      "offline, run one LLM per replica, each on its share of the machine")
        self.engine = LLMEngine(self.config)
        self._built_on = threading.get_ident()
        self._warned_thread = False

    def shutdown(self) -> None:
        """Stop the engine's rank processes now (tensor / pipeline parallel); they stop
        with the interpreter otherwise."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (a string or {"prompt_token_ids": [...]}) and return
        the outputs in input order. Bad input raises ValueError before anything runs."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        for _, ids in encoded:
            self.engine.validate_prompt(ids)
        ids = [self.engine.add_request(None, text, params, token_ids)
               for (text, token_ids), params in zip(encoded, params_list)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(conv, chat_template, add_generation_prompt,
                                                                 **template_kwargs)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        tok = self.engine.tokenizer
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; pass chat_template=")
        out = tok.apply_chat_template(conversation, chat_template=chat_template, tokenize=True,
                                      add_generation_prompt=add_generation_prompt, **kwargs)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}")

    def _warn_other_thread(self) -> None:
        """Once: steps run from another thread than the one that loaded the model. libgomp
        keeps an OpenMP thread pool per thread that opens parallel regions; with two pools it
        counts more threads than CPUs and cuts its spin-waiting short, so every kernel's
        threads sleep and wake at its end (a 32 x 32-token SmolLM2 prefill on a 2-vCPU Xeon:
        180-187 ms from the loading thread, 265-276 ms from a second one, and 232-247 ms back
        on the first once both pools exist)."""
        if self._warned_thread or threading.get_ident() == self._built_on or \
                self.config.device.resolved_device() != "cpu":
            return
        self._warned_thread = True
        logger.warning("LLM.generate() runs on another thread than the one that created this LLM: on the CPU "
                       "each thread keeps its own OpenMP pool, and two pools slowed steps ~1.5x where measured. "
                       "Create the LLM and generate on one thread (or serve it: `pagedllm serve` runs both on its "
                       "engine thread).")

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        self._warn_other_thread()
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in request_ids]
