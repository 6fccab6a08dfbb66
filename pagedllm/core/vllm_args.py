"""vLLM's engine and server arguments that pagedllm does not take (yet), in one table.

A vLLM user's command must either work or say why: every argument of `vllm serve`
that pagedllm lacks is listed here with its verdict, REFUSE (not supported yet: the
reason and what to do instead) or WARN (it would change nothing here: why). The CLI
makes each one a known flag (never argparse's "unrecognized arguments") and the Python
API knows them as keyword arguments; `judge_vllm_args` turns what was given into
message templates (spelled for the reader by `config.spell`). When a feature lands,
its row goes and its config field comes: a row whose name is a real flag is skipped.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any

REFUSE, WARN = "refuse", "warn"
LORA = ("LoRA adapters are not supported yet: merge the adapter into the base weights (peft's "
        "merge_and_unload(), then save_pretrained) and serve the merged model")
MULTIMODAL = "only the text of a multimodal model is served here (image, audio and video inputs are not supported yet)"
V0 = "vLLM's removed V0-engine option; pagedllm has one engine"
TLS = "TLS is not supported yet: put a TLS-terminating proxy (nginx, Caddy) in front of the server"
CORS = "CORS is not supported yet: the chat page at / is served by this server itself; put a proxy in front for others"
POOLING = "pagedllm only generates text; pooling models (embed, classify, score, reward) are not supported yet"
EPLB = "expert load balancing is not supported yet: {enable_expert_parallel} spreads the experts evenly"
DP_NODES = ("data parallelism spans one machine here ({data_parallel_size=N} replicas behind one server); across "
            "machines run one server per machine behind your load balancer")
OLD_SPEC = ("vLLM's older spelling: give {speculative_config={\"model\": ..., \"num_speculative_tokens\": k}} "
            "(method ngram, suffix, draft_model, eagle or eagle3)")
ALL2ALL = "expert parallelism sums the experts with one all-reduce per layer here (no all-to-all)"


@dataclass(frozen=True)
class VllmArg:
    """A vLLM argument pagedllm does not take (yet). `verdict` REFUSE: not supported yet,
    `reason` says why and what to do instead; WARN: it would change nothing here, `reason`
    says why. A value in `fine` (as text, case-insensitive; a boolean flag's False always)
    asks for what pagedllm does anyway and is accepted with a note. `kind` is the value's
    shape on the command line (str: one value, bool: --x / --no-x, list: one or more);
    `scope` "server" marks `pagedllm serve`'s own options (the Python API has none)."""

    name: str
    verdict: str
    reason: str
    kind: type = str
    scope: str = "engine"
    fine: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


def _args(*rows: tuple[Any, ...]) -> dict[str, VllmArg]:
    return {row[0]: VllmArg(*row) for row in rows}


VLLM_ONLY_ARGS: dict[str, VllmArg] = _args(
    # model
    ("task", REFUSE, POOLING, str, "engine", ("auto", "generate")),
    ("runner", REFUSE, POOLING, str, "engine", ("auto", "generate")),
    ("convert", REFUSE, POOLING, str, "engine", ("auto", "none")),
    ("tokenizer_mode", REFUSE, ("the Hugging Face tokenizer is loaded (the fast one when there is one); slow, mistral "
     "and custom modes are not supported yet: give {tokenizer=DIR} with a Hugging Face tokenizer"), str, "engine",
     ("auto", "hf")),
    ("hf_config_path", REFUSE, "the config is read from the model; change its fields with {hf_overrides}"),
    ("skip_tokenizer_init", REFUSE, "the tokenizer is always loaded (text output, stop strings)", bool),
    ("code_revision", REFUSE, "remote code is read at {revision}: give the revision there"),
    ("tokenizer_revision", REFUSE, "the tokenizer is read at {revision}; give {tokenizer=DIR} for another one"),
    ("hf_token", REFUSE, "set the HF_TOKEN environment variable: the hub download reads it"),
    ("max_logprobs", REFUSE, ("the server allows at most 20 logprobs per token (vLLM's default); another limit is "
     "not supported yet"), str, "engine", ("20",)),
    ("logprobs_mode", REFUSE, "logprobs are the model's raw log-softmax; other modes are not supported yet",
     str, "engine", ("raw_logprobs",)),
    ("disable_sliding_window", REFUSE, ("sliding-window layers always attend over their window; cap the context "
     "with {max_model_len} instead"), bool),
    ("disable_cascade_attn", WARN, "there is no cascade attention here", bool),
    ("enable_prompt_embeds", REFUSE, "prompts are text or token ids; prompt embeddings are not supported yet", bool),
    ("config_format", REFUSE, "configs are read in the Hugging Face format (or from a GGUF file)", str, "engine",
     ("auto", "hf")),
    ("pooler_config", REFUSE, POOLING),
    ("override_pooler_config", REFUSE, POOLING),
    ("logits_processor_pattern", REFUSE, ("logits processors come from plugins (the pagedllm_logits_processors "
     "hook), not from module names")),
    ("logits_processors", REFUSE, "logits processors come from plugins (the pagedllm_logits_processors hook)", list),
    ("generation_config", REFUSE, ("the model's generation_config.json is read (auto); another source is not "
     "supported yet"), str, "engine", ("auto",)),
    ("override_generation_config", REFUSE, "not supported yet: give the sampling parameters in each request"),
    ("enable_sleep_mode", REFUSE, "sleep mode (freeing GPU memory while idle) is not supported yet", bool),
    ("model_impl", REFUSE, "pagedllm runs its own model classes; the transformers backend is not supported yet",
     str, "engine", ("auto", "vllm")),
    ("override_attention_dtype", REFUSE, "attention computes in the model dtype: choose it with {dtype}"),
    ("io_processor_plugin", REFUSE, POOLING),
    ("max_seq_len_to_capture", WARN, ("captured steps (CUDA graphs, CPU step replay) have no length limit to set; "
     "{enforce_eager} turns capture off")),
    ("allowed_local_media_path", WARN, MULTIMODAL),
    ("allowed_media_domains", WARN, MULTIMODAL, list),
    ("limit_mm_per_prompt", WARN, MULTIMODAL),
    ("media_io_kwargs", WARN, MULTIMODAL),
    ("mm_processor_kwargs", WARN, MULTIMODAL),
    ("mm_processor_cache_gb", WARN, MULTIMODAL),
    ("mm_processor_cache_type", WARN, MULTIMODAL),
    ("mm_shm_cache_max_object_size_mb", WARN, MULTIMODAL),
    ("mm_encoder_tp_mode", WARN, MULTIMODAL),
    ("mm_encoder_attn_backend", WARN, MULTIMODAL),
    ("interleave_mm_strings", WARN, MULTIMODAL, bool),
    ("skip_mm_profiling", WARN, MULTIMODAL, bool),
    ("video_pruning_rate", WARN, MULTIMODAL),
    ("disable_mm_preprocessor_cache", WARN, MULTIMODAL, bool),
    ("language_model_only", WARN, MULTIMODAL, bool, "engine", ("true",)),
    # loading
    ("model_loader_extra_config", REFUSE, "loader options come from plugins (their own flags)"),
    ("ignore_patterns", REFUSE, ("every weight file of the model is read; remove the files you do not want from a copy "
     "of the model directory"), list),
    ("use_tqdm_on_load", WARN, "loading shows no progress bar here", bool, "engine", ("true", "false")),
    ("pt_load_map_location", REFUSE, "weights load onto the engine's device ({device})"),
    ("safetensors_load_strategy", WARN, "safetensors files are memory-mapped and each rank reads only its slice"),
    ("qlora_adapter_name_or_path", REFUSE, LORA),
    # structured outputs (older spellings)
    ("guided_decoding_backend", REFUSE, ("vLLM's older spelling: give {structured_outputs_config={\"backend\": "
     "NAME}} (auto, llguidance, xgrammar, outlines)")),
    # parallelism
    ("data_parallel_size_local", REFUSE, DP_NODES, str, "engine", (), ("-dpl",)),
    ("data_parallel_address", REFUSE, DP_NODES, str, "engine", (), ("-dpa",)),
    ("data_parallel_rpc_port", REFUSE, DP_NODES, str, "engine", (), ("-dpp",)),
    ("data_parallel_start_rank", REFUSE, DP_NODES, str, "engine", (), ("-dpr",)),
    ("data_parallel_backend", REFUSE, "data-parallel replicas run as processes of this server", str, "engine",
     ("mp",), ("-dpb",)),
    ("data_parallel_hybrid_lb", REFUSE, DP_NODES, bool),
    ("data_parallel_external_lb", REFUSE, DP_NODES, bool),
    ("worker_use_ray", REFUSE, "vLLM's older spelling: give {distributed_executor_backend=ray}", bool),
    ("max_parallel_loading_workers", WARN, "weights are memory-mapped and each rank reads its own slice"),
    ("ray_workers_use_nsight", REFUSE, "profiling Ray workers with Nsight is not supported yet", bool),
    ("disable_custom_all_reduce", WARN, ("all-reduces are torch.distributed's (NCCL, gloo): there is no custom "
     "all-reduce to turn off"), bool),
    ("worker_cls", REFUSE, "the worker is pagedllm's; extend it through plugins"),
    ("worker_extension_cls", REFUSE, "the worker is pagedllm's; extend it through plugins"),
    ("enable_eplb", REFUSE, EPLB, bool),
    ("eplb_config", REFUSE, EPLB),
    ("num_redundant_experts", REFUSE, EPLB, str, "engine", ("0",)),
    ("eplb_window_size", REFUSE, EPLB),
    ("eplb_step_interval", REFUSE, EPLB),
    ("eplb_log_balancedness", REFUSE, EPLB, bool),
    ("all2all_backend", WARN, ALL2ALL),
    ("expert_placement_strategy", REFUSE, ("each rank holds a contiguous range of experts (linear); another placement "
     "is not supported yet"), str, "engine", ("linear",)),
    ("enable_dbo", REFUSE, "dual-batch overlap is not supported yet", bool),
    ("dbo_decode_token_threshold", REFUSE, "dual-batch overlap is not supported yet"),
    ("dbo_prefill_token_threshold", REFUSE, "dual-batch overlap is not supported yet"),
    ("decode_context_parallel_size", REFUSE, ("context parallelism is not supported yet: use tensor or pipeline "
     "parallelism ({tensor_parallel_size}, {pipeline_parallel_size})"), str, "engine", ("1",), ("-dcp",)),
    ("dcp_kv_cache_interleave_size", REFUSE, "context parallelism is not supported yet"),
    ("prefill_context_parallel_size", REFUSE, ("context parallelism is not supported yet: use tensor or pipeline "
     "parallelism ({tensor_parallel_size}, {pipeline_parallel_size})"), str, "engine", ("1",), ("-pcp",)),
    ("disable_nccl_for_dp_synchronization", WARN, "data-parallel replicas do not synchronize their steps here",
     bool),
    # KV cache
    ("swap_space", WARN, "preempted requests are recomputed here, never swapped to CPU memory"),
    ("cpu_offload_gb", REFUSE, ("offloading weights to CPU memory is not supported yet: use a quantized model (a GGUF "
     "file, {quantization=fp8}) or more GPUs ({tensor_parallel_size})"), str, "engine", ("0",)),
    ("num_gpu_blocks_override", REFUSE, ("give the KV-cache size in bytes instead: {kv_cache_memory=SIZE} (blocks = "
     "SIZE / (block size x bytes per token), as the start-up log shows)")),
    ("prefix_caching_hash_algo", WARN, ("a prefix-cache hit is confirmed by comparing the tokens, so no hash choice "
     "can make a wrong hit")),
    ("kv_sharing_fast_prefill", REFUSE, "cross-layer KV sharing is not supported yet", bool),
    ("mamba_cache_dtype", REFUSE, "Mamba layers are not supported yet", str, "engine", ("auto",)),
    ("mamba_ssm_cache_dtype", REFUSE, "Mamba layers are not supported yet", str, "engine", ("auto",)),
    ("mamba_block_size", REFUSE, "Mamba layers are not supported yet"),
    ("kv_offloading_size", REFUSE, "offloading the KV cache to CPU memory is not supported yet"),
    ("kv_offloading_backend", REFUSE, "offloading the KV cache to CPU memory is not supported yet"),
    ("quantization_param_path", REFUSE, ("FP8 KV-cache scales come from the checkpoint's k_scale / v_scale "
     "tensors, or from the first batch with {calculate_kv_scales}")),
    # LoRA
    ("enable_lora", REFUSE, LORA, bool),
    ("max_loras", REFUSE, LORA),
    ("max_lora_rank", REFUSE, LORA),
    ("lora_extra_vocab_size", REFUSE, LORA),
    ("lora_dtype", REFUSE, LORA),
    ("max_cpu_loras", REFUSE, LORA),
    ("fully_sharded_loras", REFUSE, LORA, bool),
    ("default_mm_loras", REFUSE, LORA),
    ("enable_lora_bias", REFUSE, LORA, bool),
    ("long_lora_scaling_factors", REFUSE, LORA),
    # observability
    ("show_hidden_metrics_for_version", WARN, "no metric is hidden here: /metrics shows them all"),
    ("otlp_traces_endpoint", REFUSE, "OpenTelemetry tracing is not supported yet"),
    ("collect_detailed_traces", REFUSE, "OpenTelemetry tracing is not supported yet", list),
    ("disable_log_stats", WARN, "no periodic statistics are logged here (the server's /metrics has them)", bool),
    # scheduler
    ("max_num_partial_prefills", REFUSE, ("each step takes chunks of as many prompts as its token budget holds; a "
     "limit on them is not supported yet (lower {max_num_batched_tokens} for shorter steps)")),
    ("max_long_partial_prefills", REFUSE, ("a limit on concurrent long prefills is not supported yet (lower "
     "{max_num_batched_tokens} for shorter steps)")),
    ("long_prefill_token_threshold", REFUSE, ("a limit on concurrent long prefills is not supported yet (lower "
     "{max_num_batched_tokens} for shorter steps)"), str, "engine", ("0",)),
    ("num_lookahead_slots", REFUSE, "speculative decoding reserves its own slots ({speculative_config})", str,
     "engine", ("0",)),
    ("scheduling_policy", REFUSE, ("requests are served first come, first served; priority scheduling is not "
     "supported yet"), str, "engine", ("fcfs",)),
    ("disable_chunked_mm_input", WARN, MULTIMODAL, bool),
    ("scheduler_cls", REFUSE, "the scheduler is pagedllm's own"),
    ("disable_hybrid_kv_cache_manager", WARN, "one KV-cache manager serves every kind of layer here", bool),
    ("async_scheduling", WARN, ("the next step is scheduled when the last one ends (asynchronous scheduling is not "
     "supported yet); outputs are the same"), bool),
    ("cuda_graph_sizes", WARN, "pagedllm chooses which step shapes it captures ({enforce_eager} turns capture off)",
     list),
    ("preemption_mode", REFUSE, "preempted requests are recomputed; swapping them out is not supported", str,
     "engine", ("recompute",)),
    ("scheduler_delay_factor", REFUSE, "a waiting prompt is scheduled at the next step; a delay is not supported",
     str, "engine", ("0", "0.0")),
    ("stream_interval", REFUSE, "every token is streamed as it comes; batching them is not supported yet", str,
     "engine", ("1",)),
    ("num_scheduler_steps", WARN, V0),
    ("use_v2_block_manager", WARN, V0, bool),
    ("multi_step_stream_outputs", WARN, V0, bool),
    ("disable_async_output_proc", WARN, V0, bool),
    # speculative decoding (older spellings)
    ("speculative_model", REFUSE, OLD_SPEC),
    ("num_speculative_tokens", REFUSE, OLD_SPEC),
    ("speculative_draft_tensor_parallel_size", REFUSE, OLD_SPEC),
    ("ngram_prompt_lookup_max", REFUSE, OLD_SPEC),
    ("ngram_prompt_lookup_min", REFUSE, OLD_SPEC),
    # whole-engine configs
    ("compilation_config", WARN, ("pagedllm does not torch.compile: steps are captured and replayed (CUDA graphs, "
     "CPU step replay) unless {enforce_eager}"), str, "engine", (), ("-O",)),
    ("kv_transfer_config", REFUSE, "disaggregated prefill (KV transfer between engines) is not supported yet"),
    ("kv_events_config", REFUSE, "KV-cache events are not supported yet"),
    ("ec_transfer_config", REFUSE, "encoder-cache transfer is not supported yet"),
    ("additional_config", REFUSE, "platform-specific options are not supported"),
    # the server (`pagedllm serve` only)
    ("uds", REFUSE, "listening on a Unix socket is not supported yet: use {--host} and {--port}", str, "server"),
    ("allowed_origins", REFUSE, CORS, str, "server"),
    ("allowed_methods", REFUSE, CORS, str, "server"),
    ("allowed_headers", REFUSE, CORS, str, "server"),
    ("allow_credentials", REFUSE, CORS, bool, "server"),
    ("ssl_keyfile", REFUSE, TLS, str, "server"),
    ("ssl_certfile", REFUSE, TLS, str, "server"),
    ("ssl_ca_certs", REFUSE, TLS, str, "server"),
    ("ssl_cert_reqs", REFUSE, TLS, str, "server"),
    ("enable_ssl_refresh", REFUSE, TLS, bool, "server"),
    ("root_path", REFUSE, "serving under a path prefix is not supported yet: let the proxy strip it", str, "server"),
    ("middleware", REFUSE, "ASGI middleware from the command line is not supported", list, "server"),
    ("lora_modules", REFUSE, LORA, list, "server"),
    ("prompt_adapters", REFUSE, LORA, list, "server"),
    ("chat_template_content_format", REFUSE, ("message content is given to the chat template as the template "
     "expects (auto); forcing a format is not supported yet"), str, "server", ("auto",)),
    ("trust_request_chat_template", REFUSE, "a request's own chat template is never used here", bool, "server"),
    ("default_chat_template_kwargs", REFUSE, ("server-wide chat-template arguments are not supported yet: give "
     "chat_template_kwargs in each request"), str, "server"),
    ("response_role", REFUSE, "replies have the role assistant", str, "server", ("assistant",)),
    ("return_tokens_as_token_ids", REFUSE, "logprobs name tokens by their text", bool, "server"),
    ("enable_request_id_headers", REFUSE, "X-Request-Id headers are not supported yet", bool, "server"),
    ("enable_prompt_tokens_details", REFUSE, "usage.prompt_tokens_details is not supported yet", bool, "server"),
    ("enable_server_load_tracking", REFUSE, ("load tracking is not supported yet (/metrics has the running and "
     "waiting requests)"), bool, "server"),
    ("enable_force_include_usage", REFUSE, ("usage in every stream is not supported yet: ask for it per request "
     "(stream_options.include_usage)"), bool, "server"),
    ("enable_tokenizer_info_endpoint", REFUSE, "/tokenizer_info is not supported yet", bool, "server"),
    ("tool_server", REFUSE, "built-in tool servers are not supported yet", str, "server"),
    ("log_config_file", REFUSE, "logging is configured by pagedllm: PAGEDLLM_LOGGING_LEVEL sets its level",
     str, "server"),
    ("h11_max_incomplete_event_size", REFUSE, ("the header size limit is fixed here ({--header_timeout} bounds slow "
     "clients)"), str, "server"),
    ("h11_max_header_count", REFUSE, "the header limits are fixed here", str, "server"),
    ("grpc", REFUSE, "a gRPC server is not supported yet: the HTTP API serves every endpoint", bool, "server"),
    ("disable_frontend_multiprocessing", WARN, "the server and the engine share one process anyway", bool, "server"),
    ("enable_log_requests", WARN, "requests are not logged here (uvicorn's access log lists each one)", bool, "server"),
    ("disable_log_requests", WARN, "requests are not logged here anyway", bool, "server"),
    ("enable_log_outputs", WARN, "outputs are not logged here", bool, "server"),
    ("max_log_len", WARN, "prompts are not logged here", str, "server"),
    ("log_error_stack", WARN, "errors are logged with their stack already", bool, "server"),
    ("disable_fastapi_docs", WARN, "there are no /docs pages here", bool, "server"),
    ("disable_uvicorn_access_log", WARN, "to quiet uvicorn's access log give {--uvicorn_log_level=warning}", bool,
     "server"),
    ("aggregate_engine_logging", WARN, "no per-engine statistics are logged here", bool, "server"),
    ("fail_on_environ_validation", WARN, ("a bad value of a variable pagedllm reads always fails at start-up; an "
     "unknown PAGEDLLM_* / VLLM_* variable is warned about"), bool, "server"),
    ("reasoning_parser_plugin", REFUSE, "reasoning parsers come from plugins (the pagedllm_reasoning_parsers hook)",
     str, "server"),
)
# vLLM names for pagedllm arguments (both are accepted).
ARG_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}


def _is_fine(arg: VllmArg, value: Any) -> bool:
    if arg.kind is bool and value is False:
        return True
    text = str(value).strip().lower()
    for fine in arg.fine:
        try:
            if float(text) == float(fine):
                return True
        except ValueError:
            if text == fine:
                return True
    return False


def judge_vllm_args(given: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """(problems, warnings, notes) for vLLM-only arguments `given` by name: message templates
    (see `spell`); a refused one says "not supported yet" and what to do instead, a warned one
    why it changes nothing here, a note that it asks for what pagedllm does anyway."""
    problems, warnings, notes = [], [], []
    for name, value in given.items():
        arg = VLLM_ONLY_ARGS[name]
        shown = "{" + name + f"={_shown(value)}" + "}"
        if _is_fine(arg, value):
            notes.append(f"{shown} is what pagedllm does anyway")
        elif arg.verdict == REFUSE:
            reason = arg.reason if "not supported" in arg.reason else f"not supported yet: {arg.reason}"
            problems.append(f"{shown}: {reason}")
        else:
            warnings.append(f"{shown} has no effect here: {arg.reason}")
    return problems, warnings, notes


def _shown(value: Any) -> str:
    """A value as a message shows it; braces would end the `{name=VALUE}` of `spell`."""
    text = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    text = json.dumps(value) if isinstance(value, dict) else text
    return text if len(text) <= 60 and not set(text) & set("{}") else "..."


def unknown_argument(name: str, known: Any) -> str:
    """The message for an engine argument that is neither pagedllm's (`known`) nor vLLM's,
    with the closest name there is."""
    names = sorted(set(known) | set(VLLM_ONLY_ARGS) | set(ARG_ALIASES))
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return (f"unexpected engine argument {name!r}{hint}; accepted: {', '.join(sorted(known))} "
            "(and vLLM's other arguments, each refused or warned about with the reason)")
