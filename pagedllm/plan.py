"""`pagedllm plan`: will this model fit, before anything is loaded.

From a config.json (a model directory or the file itself) or a GGUF file's metadata and
tensor directory, and the engine flags a `serve` would get, it computes per rank: the
weights (parameters counted from the config, one function per piece of the model, times
the bytes per parameter of the dtype or quantization), the KV bytes per token and per
max-model-len sequence (the model class's KVCacheSpec, as the worker sizes it), what
remains for the cache, and so how many full-length sequences fit at once. When not one
fits, it lists the remedies in the engine's order, each with the number it gives.

The per-rank cache arithmetic and the remedies' wording are `pagedllm.core.memory`'s,
the same the engine's start-up check uses; what only the engine can measure (its
activation peak) is estimated here (`activation_reserve`). Nothing here allocates a
tensor or reads a weight.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.core.config import EngineConfig
from pagedllm.core.contracts.model import KVCacheSpec
from pagedllm.core.memory import (GiB, Remedy, cpu_kv_bytes, kv_element_size, longest_sequence_that_fits,
                                  rank_bytes_per_token, remedy_fp8_kv, remedy_max_model_len, remedy_max_num_seqs,
                                  remedy_memory, remedy_quantize, remedy_tensor_parallel, seqs_phrase,
                                  sequence_bytes, sequences_that_fit, tokens_held_per_seq)
from pagedllm.core.parallel import stage_layers
from pagedllm.core.plugins import PluginRegistry
from pagedllm.plan_weights import MoEShape, WeightFormat, gguf_pieces, moe_shape, stage_weight_bytes, \
    weight_format, weight_pieces

# What a GPU loses before the first weight lands and besides the activations of a step: the
# CUDA context (about 0.5 GiB on Hopper with lazy module loading), cuBLAS/cuBLASLt workspaces,
# NCCL buffers when there are several ranks, and the CUDA graph pool. The worker measures all
# of it as memory in use that is not its tensors; a plan can only set a figure aside.
GPU_OVERHEAD_BYTES = GiB
TP_SEARCH_LIMIT = 64  # the largest tensor-parallel size the TP remedy tries


@dataclass(frozen=True)
class Settings:
    """What the plan is asked about: the engine flags that decide memory, and the device."""

    max_model_len: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    quantization: str | None = None  # None: the checkpoint's own
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    on_gpu: bool = True
    gpu_memory: int | None = None  # bytes per GPU
    kv_cache_memory: int | None = None
    device_count: int | None = None
    gguf_keep_quantized: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class ModelFacts:
    """What the config (or GGUF metadata) says, read once: no weights."""

    path: str
    architecture: str
    hf_config: Any  # the whole config (architectures, quantization_config, tie_word_embeddings)
    text_config: Any  # the language model's (what the counting reads)
    spec: KVCacheSpec  # the model class's, for the whole model
    model_max_len: int
    model_max_source: str
    checkpoint_quantization: str | None = None
    quant_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    gguf_tensors: dict[str, tuple[tuple[int, ...], int]] | None = None  # name -> (shape, bytes in the file)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings",
                            getattr(self.text_config, "tie_word_embeddings", False)))

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)


def read_model(path: str, registry: PluginRegistry, load_format: str = "auto", options: dict[str, Any] | None = None,
               hf_overrides: dict[str, Any] | None = None, trust_remote_code: bool = False) -> ModelFacts:
    """The config of a model directory, a config.json or a GGUF file (its metadata and
    tensor sizes), and the model class's KV facts for it."""
    from pagedllm.core.loader import HFDirectory, apply_hf_overrides, derived_max_model_len, language_model_config

    if not os.path.exists(path):
        raise ValueError(f"{path!r} does not exist: give a model directory, its config.json, or a .gguf file")
    options = {**(options or {}), "trust_remote_code": trust_remote_code}
    tensors, fmt_quant = None, None
    if os.path.isfile(path) and path.endswith(".json"):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    else:
        fmt = registry.checkpoint_format(load_format, path, options)
        if fmt is None:
            if not HFDirectory.detect(path):
                raise ValueError(f"{path!r} is neither a directory with config.json, a config.json, nor a file of a "
                                 f"known format ({', '.join(sorted(registry.checkpoint_formats)) or 'none'})")
            fmt = HFDirectory(path, options)
        hf_config = fmt.hf_config()
        fmt_quant = fmt.quantization()
        directory = getattr(getattr(fmt, "file", None), "tensors", None)  # GGUF: the tensor directory
        if directory is not None:
            tensors = {name: (tuple(info.shape), int(info.num_bytes)) for name, info in directory.items()}
    if hf_overrides:
        apply_hf_overrides(hf_config, hf_overrides)
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_cls = registry.model_class(architectures)
    text_config = language_model_config(hf_config)
    model_max, derived = derived_max_model_len(text_config)
    quant_config = dict(getattr(hf_config, "quantization_config", None) or {})
    known = [a for a in architectures if a in registry.model_architectures]
    return ModelFacts(path=path, architecture=known[0], hf_config=hf_config, text_config=text_config, spec=model_cls.kv_cache_spec(hf_config),
                      model_max_len=model_max, model_max_source=derived,
                      checkpoint_quantization=quant_config.get("quant_method") or fmt_quant,
                      quant_config=quant_config, gguf_tensors=tensors)


def compute_dtype_bytes(facts: ModelFacts, settings: Settings) -> tuple[int, str, int | None]:
    """The engine's compute dtype (the worker's rule), its size, and the size of the dense
    weights where they keep another dtype (a 16-bit checkpoint computed in float32 on the
    CPU keeps its weights bf16), else None."""
    import torch

    from pagedllm.core.worker import dense_weight_dtype, resolve_dtype

    device = "cuda" if settings.on_gpu else "cpu"
    quantized = bool(settings.quantization or facts.checkpoint_quantization)
    dtype = resolve_dtype(settings.dtype, facts.hf_config, device, quantized)
    dense = dense_weight_dtype(settings.dtype, facts.hf_config, device, quantized)
    def size(d: torch.dtype) -> int:
        return torch.empty((), dtype=d).element_size()

    return size(dtype), str(dtype).replace("torch.", ""), None if dense is None else size(dense)


def cpu_multiplies_bf16() -> bool:
    """Whether a 16-bit checkpoint computed in float32 keeps its weights and KV cache in bf16
    on this CPU (the CPU plugin's rule: native bf16 products, not turned off by
    PAGEDLLM_FLOAT32_MATMUL_PRECISION=highest or PAGEDLLM_CPU_KERNELS=0); elsewhere both
    are widened to float32."""
    from pagedllm.core import envs, precision
    from pagedllm.ops.cpu import dense, native

    chosen, _ = precision.resolve(envs.get("PAGEDLLM_FLOAT32_MATMUL_PRECISION"), "auto", False, half_weights=True)
    with precision.matmul_precision(chosen):
        return dense.bf16_products_allowed() and native.switched_on()


# ---------------------------------------------------------------------- activations


def activation_reserve(cfg: Any, spec: KVCacheSpec, moe: MoEShape | None, tp: int, dtype_bytes: int,
                       step_tokens: int, logit_rows: int, last_stage: bool) -> int:
    """An estimate of the peak activation memory of one maximal step on one rank, which the
    worker measures by running it: per token, the residual stream and the normed input
    (4 x hidden) plus the widest intermediate of a layer (q/k/v and the attention output;
    MLA's latent queries and outputs; the MLP's gate, up and product; or the routed copies
    of a token and its float32 router scores), in the compute dtype; and on the last stage
    float32 logits for `logit_rows` rows twice (the logits and the sampler's probabilities)."""
    hidden = int(cfg.hidden_size)
    heads = spec.num_heads // tp
    if spec.kind == "mla":
        attention = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + 2 * cfg.kv_lora_rank + cfg.v_head_dim)
    else:
        kv_heads = max(1, spec.num_kv_heads // tp)
        attention = (2 * heads + 2 * kv_heads) * spec.head_size
    if moe is None:
        dense = int(getattr(cfg, "intermediate_size", 0) or 0)
    else:  # only where some layer keeps a dense MLP
        dense = moe.dense_size if len(moe.layers) < int(cfg.num_hidden_layers) else 0
    widest = max(attention, 3 * dense // tp)
    if moe is not None:
        routed = moe.top_k * (3 * moe.expert_size // tp + hidden) + moe.num_experts * 4 // dtype_bytes
        widest = max(widest, routed + 3 * moe.shared_size // tp)
    per_token = (4 * hidden + widest) * dtype_bytes
    logits = 2 * logit_rows * int(cfg.vocab_size) * 4 if last_stage else 0
    return step_tokens * per_token + logits


# ---------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's rank (each of its tensor-parallel ranks holds the same)."""

    stage: int
    layers: int
    weight_bytes: int
    reserve_bytes: int  # activation reserve (GPU), 0 on the CPU
    kv_available: int  # bytes for the cache on this rank
    kv_bytes_per_token: int
    seqs_fit: int


@dataclass
class Plan:
    facts: ModelFacts
    settings: Settings
    weights: WeightFormat
    total_params: int
    total_weight_bytes: int
    stages: list[StagePlan]
    tokens_held: int
    kv_element_size: int
    kv_source: str
    step_tokens: int
    remedies: list[Remedy] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def weight_bytes_per_rank(self) -> int:
        return max(s.weight_bytes for s in self.stages)

    @property
    def kv_bytes_per_token(self) -> int:
        return max(s.kv_bytes_per_token for s in self.stages)

    @property
    def kv_bytes_per_sequence(self) -> int:
        return sequence_bytes(self.kv_bytes_per_token, self.settings.block_size, self.tokens_held)

    @property
    def binding(self) -> StagePlan:
        """The stage that holds the fewest sequences: the engine's one block table obeys it."""
        return min(self.stages, key=lambda s: s.seqs_fit)

    @property
    def max_num_seqs_fit(self) -> int:
        return self.binding.seqs_fit

    @property
    def fits(self) -> bool:
        return self.max_num_seqs_fit >= 1


def check_layout(facts: ModelFacts, settings: Settings) -> None:
    """The splits the engine refuses, refused here with its reasons."""
    tp = settings.tensor_parallel_size
    facts.spec.for_tensor_parallel(tp)  # heads that do not divide
    stage_layers(facts.num_layers, settings.pipeline_parallel_size, 0)
    moe = moe_shape(facts.text_config)
    if tp > 1 and moe is not None:
        if settings.enable_expert_parallel and moe.num_experts % tp:
            raise ValueError(f"expert parallelism over {tp} ranks needs a number of experts divisible by {tp}, the "
                             f"model has {moe.num_experts}")
        if not settings.enable_expert_parallel and moe.expert_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the experts' intermediate size "
                             f"{moe.expert_size}; pick a size that does, or --enable-expert-parallel")


def make_plan(facts: ModelFacts, settings: Settings) -> Plan:
    """Every number of the plan, without remedies (see `plan_with_remedies`)."""
    check_layout(facts, settings)
    cfg, tp, pp = facts.text_config, settings.tensor_parallel_size, settings.pipeline_parallel_size
    dtype_bytes, dtype_name, dense_bytes = compute_dtype_bytes(facts, settings)
    moe = moe_shape(cfg)
    quant = settings.quantization or facts.checkpoint_quantization
    if facts.gguf_tensors is not None:
        dense = None if settings.gguf_keep_quantized else dtype_bytes
        fmt = WeightFormat("gguf file sizes" if dense is None else f"gguf dequantized to {dtype_name}",
                           dense or 1.0, dtype_bytes)
        pieces = gguf_pieces(facts.gguf_tensors, cfg, facts.spec, moe, dense)
    else:
        fmt = weight_format(quant, facts.quant_config if quant == facts.checkpoint_quantization else {},
                            dtype_bytes, dtype_name)
        if dense_bytes is not None:  # a 16-bit checkpoint computed in float32 (the CPU)
            if not cpu_multiplies_bf16():
                dense_bytes = None  # its linear weights and KV cache widened to float32
            fmt = WeightFormat(f"bfloat16 weights, {dtype_name} activations", dense_bytes or dtype_bytes, 2)
        pieces = weight_pieces(cfg, facts.spec, moe, fmt, facts.tied)
    weights = stage_weight_bytes(pieces, facts.num_layers, tp, pp, settings.enable_expert_parallel, facts.tied)
    element = kv_element_size(settings.kv_cache_dtype, dense_bytes or dtype_bytes)
    held = tokens_held_per_seq(settings.max_model_len, facts.spec.kv_window, settings.max_num_batched_tokens,
                               settings.block_size)
    step_tokens = min(settings.max_num_batched_tokens, settings.max_model_len)
    rows = min(step_tokens, settings.max_num_seqs)
    stages = []
    for stage, weight_bytes in enumerate(weights):
        layers = len(stage_layers(facts.num_layers, pp, stage))
        bpt = rank_bytes_per_token(facts.spec, element, tp, layers)
        reserve = 0
        if settings.kv_cache_memory is not None:
            available, source = settings.kv_cache_memory, "kv_cache_memory"
        elif settings.on_gpu:
            reserve = GPU_OVERHEAD_BYTES + activation_reserve(cfg, facts.spec, moe, tp, dtype_bytes, step_tokens,
                                                              rows, stage == pp - 1)
            available = int(settings.gpu_memory * settings.gpu_memory_utilization) - weight_bytes - reserve
            source = f"gpu_memory_utilization={settings.gpu_memory_utilization:g} of {_size(settings.gpu_memory)}"
        else:
            available, source = cpu_kv_bytes(None)
        stages.append(StagePlan(stage, layers, weight_bytes, reserve, available, bpt,
                                sequences_that_fit(available, bpt, settings.block_size, held)))
    return Plan(facts, settings, fmt, sum(p.params for p in pieces), sum(p.nbytes for p in pieces), stages, held,
                element, source, step_tokens)


def plan_with_remedies(facts: ModelFacts, settings: Settings) -> Plan:
    """The plan, and when not one sequence fits, what to change, each with its number."""
    plan = make_plan(facts, settings)
    if settings.device_count is not None and settings.world_size > settings.device_count:
        plan.notes.append(f"tensor_parallel_size x pipeline_parallel_size = {settings.world_size} ranks, but "
                          f"--device-count is {settings.device_count}")
    if not plan.fits:
        plan.remedies = remedies(plan)
    return plan


def _try(facts: ModelFacts, settings: Settings, **changes: Any) -> Plan | None:
    """The plan with one change, or None where the engine would refuse that change."""
    try:
        return make_plan(facts, dataclasses.replace(settings, **changes))
    except (ValueError, NotImplementedError):
        return None


def _per_rank(plan: Plan) -> str:
    return (f"{_size(plan.weight_bytes_per_rank)} of weights per rank, "
            f"{seqs_phrase(plan.max_num_seqs_fit, plan.settings.max_model_len)}")


def remedies(plan: Plan) -> list[Remedy]:
    """The engine's remedies in its order, each computed by re-planning with that one
    change: the longest max-model-len that fits, the largest max-num-seqs that does, what
    an fp8 cache holds, the smallest tensor-parallel size that fits, fp8 weights, and the
    utilization (or cache size) needed."""
    facts, s = plan.facts, plan.settings
    out = [remedy_max_model_len(s.max_model_len, min(longest_sequence_that_fits(st.kv_available, st.kv_bytes_per_token,
                                                                                s.block_size) for st in plan.stages))]
    if s.on_gpu and s.kv_cache_memory is None:
        out.append(_max_num_seqs_remedy(plan))
    else:
        out.append(remedy_max_num_seqs(s.max_num_seqs, result="no effect on a cache of fixed size", fits=False))
    if plan.kv_element_size > 1:
        fp8 = make_plan(facts, dataclasses.replace(s, kv_cache_dtype="fp8"))
        out.append(remedy_fp8_kv(plan.kv_element_size, seqs_phrase(fp8.max_num_seqs_fit, s.max_model_len), fp8.fits))
    out.append(_tensor_parallel_remedy(plan))
    if facts.gguf_tensors is None and plan.weights.linear_bytes > 1:
        fp8 = _try(facts, s, quantization="fp8")
        if fp8 is not None:
            out.append(remedy_quantize("fp8", _per_rank(fp8), fp8.fits))
    worst = max(plan.stages, key=lambda st: sequence_bytes(st.kv_bytes_per_token, s.block_size, plan.tokens_held)
                - st.kv_available)
    needed = sequence_bytes(worst.kv_bytes_per_token, s.block_size, plan.tokens_held)
    source = "kv_cache_memory" if s.kv_cache_memory is not None else plan.kv_source
    out.append(remedy_memory(s.on_gpu, source, needed, needed - worst.kv_available, s.gpu_memory,
                             s.gpu_memory_utilization))
    return out


def _max_num_seqs_remedy(plan: Plan) -> Remedy:
    """The largest max-num-seqs below the current one that fits (fewer logit rows)."""
    s = plan.settings
    low = _try(plan.facts, s, max_num_seqs=1)
    if low is None or not low.fits or s.max_num_seqs == 1:
        return remedy_max_num_seqs(s.max_num_seqs, result="even --max-num-seqs 1 does not make room", fits=False)
    lo, hi = 1, s.max_num_seqs - 1  # lo fits; find the largest that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = _try(plan.facts, s, max_num_seqs=mid)
        lo, hi = (mid, hi) if trial is not None and trial.fits else (lo, mid - 1)
    best = make_plan(plan.facts, dataclasses.replace(s, max_num_seqs=lo))
    return remedy_max_num_seqs(s.max_num_seqs, lo, seqs_phrase(best.max_num_seqs_fit, s.max_model_len), True)


def _tensor_parallel_remedy(plan: Plan) -> Remedy:
    """The smallest larger tensor-parallel size (doubling) that fits, else the largest valid one tried."""
    s = plan.settings
    limit = TP_SEARCH_LIMIT if s.device_count is None else max(1, s.device_count // s.pipeline_parallel_size)
    tried: tuple[int, Plan] | None = None
    tp = s.tensor_parallel_size * 2
    while tp <= limit:
        trial = _try(plan.facts, s, tensor_parallel_size=tp)
        if trial is not None:
            tried = (tp, trial)
            if trial.fits:
                break
        tp *= 2
    if tried is None:
        return remedy_tensor_parallel(result=f"no larger size up to {limit} GPUs splits this model", fits=False)
    tp, trial = tried
    gpus = tp * s.pipeline_parallel_size
    return remedy_tensor_parallel(tp, f"{_per_rank(trial)} ({gpus} GPUs)", trial.fits)


# ---------------------------------------------------------------------- from the engine flags


def settings_from_config(config: EngineConfig, facts: ModelFacts, gpu_memory: int | None = None,
                         device_count: int | None = None) -> Settings:
    """The plan's settings from the engine's validated config: the flags a `serve` would get.
    The device's memory: `gpu_memory`, else the visible CUDA device's; on `--device cpu`
    the CPU's cache rule."""
    max_len = config.model.max_model_len or facts.model_max_len
    if max_len > facts.model_max_len:
        raise ValueError(f"max_model_len={max_len} is longer than the model's {facts.model_max_source}; lower "
                         "--max-model-len")
    on_gpu = config.device.device != "cpu"
    if on_gpu and gpu_memory is None:
        gpu_memory, seen = _visible_gpu()
        if gpu_memory is None:
            raise ValueError("no CUDA device is visible here, so the plan needs the memory of the GPU you will run "
                             "on: pass --gpu-memory (e.g. 80GiB for an H100, 141GiB for an H200), or --device cpu "
                             "for the CPU's KV-cache rule")
        device_count = device_count if device_count is not None else seen
    par = config.parallel
    return Settings(max_model_len=max_len, tensor_parallel_size=par.tensor_parallel_size,
                    pipeline_parallel_size=par.pipeline_parallel_size,
                    enable_expert_parallel=par.enable_expert_parallel, quantization=config.model.quantization,
                    kv_cache_dtype=config.cache.kv_cache_dtype, dtype=config.model.dtype,
                    max_num_seqs=config.scheduler.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens(max_len), block_size=config.cache.block_size,
                    gpu_memory_utilization=config.cache.gpu_memory_utilization, on_gpu=on_gpu,
                    gpu_memory=gpu_memory if on_gpu else None, kv_cache_memory=config.cache.kv_cache_memory,
                    device_count=device_count,
                    gguf_keep_quantized=bool(config.plugin_options.get("gguf_keep_quantized", False)))


def _visible_gpu() -> tuple[int | None, int | None]:
    import torch

    if not torch.cuda.is_available():
        return None, None
    return int(torch.cuda.get_device_properties(0).total_memory), torch.cuda.device_count()


def plan_from_config(config: EngineConfig, gpu_memory: int | None = None, device_count: int | None = None,
                     registry: PluginRegistry | None = None) -> Plan:
    """`pagedllm plan`'s work: read the model's config and plan it under the engine flags."""
    from pagedllm.core.config import default_model
    from pagedllm.core.plugins import get_registry

    registry = registry or get_registry()
    facts = read_model(config.model.model or default_model(), registry, config.model.load_format,
                       config.plugin_options, config.model.hf_config_overrides(), config.model.trust_remote_code)
    plan = plan_with_remedies(facts, settings_from_config(config, facts, gpu_memory, device_count))
    if config.spec.speculative_config:
        plan.notes.append("speculative decoding is not counted: a draft model's weights and cache come on top")
    return plan


# ---------------------------------------------------------------------- output


def _size(n: int) -> str:
    if abs(n) < GiB:
        return f"{n / (1 << 20):.1f} MiB ({n / 1e6:.1f} MB)"
    return f"{n / GiB:.2f} GiB ({n / 1e9:.2f} GB)"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def to_json(plan: Plan) -> dict[str, Any]:
    """The plan as one JSON object (byte counts are per rank unless named total)."""
    s = plan.settings
    return {
        "model": plan.facts.path, "architecture": plan.facts.architecture,
        "weight_bytes_per_rank": plan.weight_bytes_per_rank, "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_bytes_per_sequence": plan.kv_bytes_per_sequence, "max_num_seqs_fit": plan.max_num_seqs_fit,
        "fits": plan.fits, "total_params": plan.total_params, "total_weight_bytes": plan.total_weight_bytes,
        "weights": plan.weights.name, "kv_element_size": plan.kv_element_size,
        "kv_cache_bytes": max(0, plan.binding.kv_available), "activation_reserve_bytes": plan.binding.reserve_bytes,
        "gpu_memory_bytes": s.gpu_memory, "kv_source": plan.kv_source,
        "settings": dataclasses.asdict(s),
        "stages": [dataclasses.asdict(st) for st in plan.stages],
        "remedies": [{"key": r.key, "text": r.text, "fits": r.fits} for r in plan.remedies],
        "notes": plan.notes,
    }


def report(plan: Plan) -> str:
    """The plan for a person: one fact per line, then the verdict and the remedies."""
    s, f = plan.settings, plan.facts
    lines = [f"pagedllm plan: {f.path} ({f.architecture}, {f.num_layers} layers)",
             (f"  parameters          {_count(plan.total_params)}; weights {plan.weights.name}, "
              f"{_size(plan.total_weight_bytes)} in all"),
             f"  layout              tensor-parallel {s.tensor_parallel_size} x pipeline-parallel "
             f"{s.pipeline_parallel_size} = {s.world_size} rank(s)"
             + (", experts spread over the tensor-parallel ranks" if s.enable_expert_parallel else ""),
             f"  weights per rank    {_size(plan.weight_bytes_per_rank)}"
             + (" (the largest stage)" if len(plan.stages) > 1 else "")]
    b = plan.binding
    if s.on_gpu and s.kv_cache_memory is None:
        lines.append(f"  GPU memory          {_size(s.gpu_memory)} x {s.gpu_memory_utilization:g} = "
                     f"{_size(int(s.gpu_memory * s.gpu_memory_utilization))} usable per GPU")
        lines.append(f"  activation reserve  {_size(b.reserve_bytes)}: {GPU_OVERHEAD_BYTES / GiB:g} GiB for the CUDA "
                     "context, library workspaces, NCCL and CUDA graphs, plus the estimated peak of one "
                     f"{plan.step_tokens}-token step")
    room = _size(b.kv_available) if b.kv_available >= 0 else \
        f"none: the weights and the reserve exceed it by {_size(-b.kv_available)}"
    lines += [f"  KV cache per rank   {room} ({plan.kv_source})",
              (f"  KV per token        {plan.kv_bytes_per_token} bytes per rank ({plan.kv_element_size}-byte "
               f"elements, {f.spec.kind})"),
              f"  KV per sequence     {_size(plan.kv_bytes_per_sequence)} per rank at max-model-len {s.max_model_len}"
              + (f" (holds {plan.tokens_held} tokens: every layer is windowed)"
                 if plan.tokens_held < s.max_model_len else "")]
    if len(plan.stages) > 1:
        for st in plan.stages:
            lines.append(f"  stage {st.stage}: {st.layers} layers, weights {_size(st.weight_bytes)}, "
                         f"KV {_size(max(0, st.kv_available))}, {st.seqs_fit} sequences")
    lines += [(f"  sequences           {plan.max_num_seqs_fit} of {s.max_model_len} tokens fit at once "
               f"(--max-num-seqs {s.max_num_seqs})"),
              f"  verdict             {'fits' if plan.fits else 'DOES NOT FIT'}"]
    lines += [f"  note: {n}" for n in plan.notes]
    if plan.remedies:
        lines.append("Try, in this order (each alone):")
        lines += [f"  {i}) {r}" for i, r in enumerate(plan.remedies, 1)]
    return "\n".join(lines)
