"""The model runner: owns the model, the KV cache and the sampler.

Each step it flattens the scheduled requests into one token stream (vectorized, no
per-token Python), lets the attention backend build its metadata once, runs the model
once, and computes logits only for rows that produce a token.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from pagedllm.core import cpu_allocator, cpu_threads, envs, precision
from pagedllm.core.config import EngineConfig
from pagedllm.core.parallel import ParallelState, stage_layers
from pagedllm.core.step import RankRequests, StepEncoder, StepMessage
from pagedllm.core.contracts import (
    AttentionContext,
    AttentionSpec,
    BatchLayout,
    CausalLM,
    DraftModel,
    EmbeddingMethod,
    GraphRunner,
    IntermediateTensors,
    KVCacheSpec,
    LinearMethod,
    ModelContext,
    MoEMethod,
    ProposalBatch,
    ProposerContext,
    QuantConfig,
    SpecDecodeConfig,
    SpecProposer,
    TargetStep,
)
from pagedllm.core.loader import ModelSource
from pagedllm.core.memory import (GiB, KVBudget, cpu_kv_bytes, cpu_prefault_blocks, plan_kv_cache,
                                  tokens_held_per_seq)
from pagedllm.core.plugins import PluginRegistry
from pagedllm.core.request import Request
from pagedllm.core.sampler import Sampler, SamplerOutput, logprob_entries
from pagedllm.core.scheduler import SchedulerOutput

logger = logging.getLogger("pagedllm")

DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float": torch.float32, "float32": torch.float32}


def checkpoint_dtype(hf_config: Any) -> torch.dtype:
    """The dtype a checkpoint's config names (float32 where it names none)."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    return DTYPES.get(dtype, torch.float32) if isinstance(dtype, str) else dtype


def resolve_dtype(requested: str, hf_config: Any, device: str, quantized: bool = False) -> torch.dtype:
    """The compute dtype: `requested`, or for "auto" the checkpoint's, except on the CPU,
    where an unquantized 16-bit checkpoint computes in float32 over its bf16 weights
    (`dense_weight_dtype`: bf16 products, float32 activations; faster than bf16
    activations there, whose ops convert around the float32 kernels) and a quantized
    float16 one in bfloat16."""
    if requested != "auto":
        return DTYPES[requested]
    dtype = checkpoint_dtype(hf_config)
    if dense_weight_dtype(requested, hf_config, device, quantized) is not None:
        return torch.float32
    if device == "cpu" and dtype == torch.float16:
        logger.info("float16 is slow on the CPU; using bfloat16 (pass --dtype to override)")
        return torch.bfloat16
    return dtype


def dense_weight_dtype(requested: str, hf_config: Any, device: str, quantized: bool) -> torch.dtype | None:
    """bf16 where `resolve_dtype` runs a 16-bit checkpoint in float32 (`--dtype auto`, the
    CPU, no quantization): the dtype its dense weights are created in (a float16
    checkpoint's are rounded to bf16, as its bf16 run did); None: the compute dtype."""
    if requested != "auto" or device != "cpu" or quantized:
        return None
    return torch.bfloat16 if checkpoint_dtype(hf_config) in (torch.bfloat16, torch.float16) else None


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU it is an anonymous memory map, so the OS hands out
    zero pages on first touch instead of the engine writing gigabytes at start-up; where
    the kernel allows, the map asks for transparent huge pages, since first touches in
    4 KiB pages (one fault each) otherwise cost a prefill a page fault per 5 cached tokens."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # private: a shared anonymous map is shmem, which transparent huge pages skip (with
    # the usual shmem_enabled=never), so every 4 KiB page faulted on its own
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # kernels without transparent huge pages: 4 KiB pages then
            pass
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps the map alive


def prefault(caches: Sequence[torch.Tensor], full_shape: tuple[int, ...], prefix_shape: tuple[int, ...]) -> int:
    """Write zeros over the first blocks of every layer's cache, so that their pages are
    faulted in now rather than by the first steps that write them. `prefix_shape` is the
    backend's shape for that many blocks: the one dimension where it differs from
    `full_shape` is the block dimension, whatever the layout (none or several: nothing done).
    Returns the bytes written.

    Why: a CPU cache is an anonymous map (see `zeroed`), and a page's first write faults.
    On the 2-vCPU VMs this project is measured on, the host backs guest memory lazily and
    a first touch cost ~10-15 us per 4 KiB page (~6 ms per 2 MiB huge page when the kernel
    compacts for it): a 1024-token SmolLM2 prefill spent 70-90 ms of ~500 writing fresh
    blocks, and every decode step that opened new blocks for 32 requests 15-30 ms more."""
    dims = [i for i, (a, b) in enumerate(zip(full_shape, prefix_shape)) if a != b]
    whole = tuple(full_shape) == tuple(prefix_shape)  # the prefix is the whole cache
    if len(full_shape) != len(prefix_shape) or (len(dims) != 1 and not whole):
        return 0
    written = 0
    for cache in caches:
        if tuple(cache.shape) == tuple(full_shape):
            head = cache if whole else cache.narrow(dims[0], 0, prefix_shape[dims[0]])
            head.zero_()
            written += head.numel() * head.element_size()
    return written


PAGE_BYTES = 4096
IDLE_FAULT_IN_RESERVE = 1 << 30  # memory idle fault-in leaves available to the rest of the machine


def memory_available() -> int | None:
    """The kernel's estimate of the bytes available to new allocations (MemAvailable in
    /proc/meminfo); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class IdleFaultIn:
    """Faults in the pages of the CPU KV cache past its start-up prefix, a few MiB at a time,
    while the engine has nothing to run (`step`, called by the serving loop between requests).

    Why: blocks are handed out never-used first (they hold no cached prefix), so a server
    writes fresh pages until its whole cache has been touched once, and on the 2-vCPU VMs this
    project is measured on a fresh 2 MiB huge page's first write took ~5 ms (26 us once
    faulted): past the start-up prefix (PAGEDLLM_CPU_KV_PREFAULT_MB), a SmolLM2 prefill of
    32 x 32 tokens spent 50-70 ms of ~250 in `write_kv` against 4-5 ms.

    Each page is written with its own value (one byte per 4 KiB page, plus zero), so blocks
    already in use, or holding a cached prefix, keep their contents; only the engine thread
    writes the cache, and only between steps. It stops for good where the machine's available
    memory falls below IDLE_FAULT_IN_RESERVE (a cache sized beyond the RAM left ran as long as
    its requests did not fill it, and must go on running) or cannot be read."""

    def __init__(self, caches: Sequence[torch.Tensor]) -> None:
        self._regions = [c.view(-1).view(torch.uint8) for c in caches if c.numel() and c.is_contiguous()]
        self._region, self._offset = 0, 0

    @property
    def done(self) -> bool:
        return self._region >= len(self._regions)

    def step(self, max_bytes: int) -> bool:
        """Fault in (at most) the next `max_bytes` of the caches; False once all are."""
        if self.done:
            return False
        available = memory_available()
        if available is None or available < IDLE_FAULT_IN_RESERVE + max_bytes:
            logger.info("KV cache: stopped faulting in pages while idle (%s memory available)",
                        "unknown" if available is None else f"{available / (1 << 30):.2f} GiB")
            self._region = len(self._regions)
            return False
        left = max_bytes
        while left > 0 and not self.done:
            region = self._regions[self._region]
            end = min(region.numel(), self._offset + left)
            region[self._offset:end:PAGE_BYTES].add_(0)
            left -= end - self._offset
            self._offset = end
            if end == region.numel():
                self._region, self._offset = self._region + 1, 0
        return not self.done


def _quant_config(flag: str | None, source: ModelSource, registry: PluginRegistry,
                  options: dict[str, Any]) -> QuantConfig | None:
    """The quantizer for this checkpoint and `--quantization` flag, or None.

    The checkpoint's own format wins; a flag naming another format is refused (a flag
    must never silently override what the checkpoint says), and a flag on a float
    checkpoint needs a format that quantizes while loading (`QuantConfig.quantizes_dense`)."""
    saved = source.quantization
    if flag is None and saved is None:
        return None
    if saved is not None:
        cls = registry.quant_class(saved)
        if flag is not None and registry.quant_class(flag) is not cls:
            raise ValueError(f"--quantization {flag}: the checkpoint is saved as {saved!r} (its "
                             f"quantization_config); drop the flag or pass --quantization {saved}")
        return cls.from_config(dict(source.quantization_config), dict(options))
    cls = registry.quant_class(flag)
    if not cls.quantizes_dense:
        raise ValueError(f"--quantization {flag} needs a checkpoint saved in that format (a "
                         f"quantization_config with quant_method {cls.name!r}); this one is unquantized. "
                         "Formats that quantize a float checkpoint while loading: "
                         f"{', '.join(sorted(n for n, c in registry.quant_methods.items() if c.quantizes_dense)) or 'none here'}")
    return cls.from_config({}, dict(options))


def process_after_loading(model: torch.nn.Module) -> None:
    """Give every layer's linear, embedding or experts method its one chance to repack
    loaded weights, once every tensor is in (the core does it, for every model)."""
    for module in model.modules():
        method = getattr(module, "method", None)
        if isinstance(method, (LinearMethod, EmbeddingMethod, MoEMethod)):
            method.process_after_loading(module)
    if isinstance(model, CausalLM):
        model.after_loading()


def _common_window(specs: Sequence[KVCacheSpec]) -> int | None:
    """The window past which no layer of any of `specs` reads (None: some layer is global)."""
    windows = [spec.kv_window for spec in specs]
    return None if any(w is None for w in windows) else max(windows)  # type: ignore[type-var]


@dataclass
class StepResult:
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[Any]]
    # per request asking prompt_logprobs: (prompt token, logprob entry) for the prompt
    # positions this step computed that it has no record of yet, in order
    prompt_logprobs: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)


PROMPT_LOGPROBS_SLICE = 256  # prompt rows turned into vocabulary-wide logits at a time


class Worker:
    """One rank's model runner. Every rank runs `run(StepMessage)`; the driver (rank 0)
    also encodes the scheduler's output into that message, samples and proposes
    (`execute`). With one rank the driver is the only one."""

    def __init__(self, config: EngineConfig, source: ModelSource, registry: PluginRegistry,
                 max_model_len: int, max_num_batched_tokens: int,
                 spec_config: SpecDecodeConfig | None = None, parallel: ParallelState | None = None) -> None:
        self.config = config
        self.parallel = parallel = parallel or ParallelState.single()
        self.device = torch.device(config.device.resolved_device())
        local_rank, local_ranks = config.parallel.local_rank(parallel.rank)
        if self.device.type == "cuda" and local_ranks > 1:
            # a rank that sees fewer GPUs than the node has (a Ray actor sees its own one) takes its share
            self.device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        quant = _quant_config(config.model.quantization, source, registry, config.plugin_options)
        self.dtype = resolve_dtype(config.model.dtype, source.hf_config, self.device.type, quant is not None)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        torch.manual_seed(config.model.seed)

        self.registry = registry
        model_cls = registry.model_class(list(getattr(source.hf_config, "architectures", None) or []))
        self.matmul_precision = "highest"
        if self.dtype == torch.float32:
            half = self._dense_weights(source, quant) is not None
            self.matmul_precision, why = precision.resolve(
                envs.get("PAGEDLLM_FLOAT32_MATMUL_PRECISION"), config.model.dtype, quant is not None, half)
            logger.info("float32 matmul precision %s (%s)", self.matmul_precision, why)
        # this rank's share of the heads, and the layers its pipeline stage holds
        self.kv_spec = model_cls.kv_cache_spec(source.hf_config).for_tensor_parallel(parallel.tp.size)
        self.stage_layers = parallel.stage_layers(self.kv_spec.num_layers)
        self.attn_spec = self._attention_spec(self.kv_spec)
        requested, decided_by = _requested_backend(config)
        self.backend = registry.attention_backend(requested, self.attn_spec)
        logger.info("attention backend %s (%s)", self.backend.name, decided_by)
        self.kv_dtype = self.backend.kv_cache_dtype(self.attn_spec)
        if self.device.type == "cpu":
            logger.info("CPU threads: %s", cpu_threads.apply(envs.get("PAGEDLLM_CPU_OMP_THREADS_BIND"),
                                                             local_rank, local_ranks))
            logger.info("CPU memory: %s", cpu_allocator.apply(envs.get("PAGEDLLM_CPU_MALLOC_REUSE_MB")))
            if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
                logger.warning("CUDA_VISIBLE_DEVICES=%s has no effect: the engine runs on the CPU",
                               os.environ["CUDA_VISIBLE_DEVICES"])
        start = time.perf_counter()
        self.model: CausalLM = self._build_model(model_cls, source, quant)
        if self.device.type == "cpu":
            cpu_allocator.release_free()  # what loading freed need not stay resident
        logger.info("loaded %s weights in %.1fs", type(self.model).__name__, time.perf_counter() - start)
        self.builder = self.backend.builder_cls()(self.attn_spec)
        self.graph_runner: GraphRunner | None = None  # chosen below; the CUDA profile step runs eagerly
        self.proposer: SpecProposer | None = None
        if spec_config is not None:
            if parallel.world_size > 1 and (spec_config.model or registry.spec_method(spec_config.method).needs_model):
                raise NotImplementedError(
                    f"speculative method {spec_config.method!r} runs a model of its own, which cannot be split over "
                    "ranks yet; with tensor or pipeline parallelism use a model-free method (ngram, suffix)")
            self.proposer = self._proposer(spec_config, source)
        draft_spec = self.proposer.kv_cache_spec() if self.proposer is not None else None
        # tokens older than this are never read again by any layer (target or proposer)
        self.kv_window = _common_window([self.kv_spec] + ([draft_spec] if draft_spec is not None else []))
        self.budget = self._plan_memory(draft_spec)
        self.kv_caches = self._allocate(self.kv_spec, self.stage_layers)
        caches = list(self.kv_caches)
        if draft_spec is not None:
            draft_caches = self._allocate(draft_spec)
            self.proposer.bind_kv_caches(draft_caches)
            caches += draft_caches
        # the rest of a CPU cache is faulted in while the engine idles, unless the user sized the prefault
        self.idle_fault_in = IdleFaultIn(caches) if self.device.type == "cpu" and \
            envs.get("PAGEDLLM_CPU_KV_PREFAULT_MB") is None else None
        self.sampler = Sampler(config.model.seed, self.device)
        if parallel.world_size > 1:
            logger.info("graph capture: off with more than one rank (not supported yet); every step runs eagerly")
        elif not config.device.enforce_eager:
            self.graph_runner = self._graph_runner(registry)
        self._last_step: TargetStep | None = None
        self.encoder = StepEncoder()  # the driver's record of what the ranks hold
        self.held = RankRequests()  # this rank's copy of every live request's tokens and blocks

    # ------------------------------------------------------------------ set-up helpers

    def _attention_spec(self, kv_spec: KVCacheSpec) -> AttentionSpec:
        return AttentionSpec(num_heads=kv_spec.num_heads, num_kv_heads=kv_spec.num_kv_heads,
                             head_size=kv_spec.head_size, dtype=self.dtype,
                             kv_cache_dtype=self.config.cache.kv_cache_dtype, block_size=self.block_size,
                             device=self.device, matmul_precision=self.matmul_precision,
                             kind=kv_spec.kind, value_size=kv_spec.value_size, chunked=kv_spec.chunked)

    def _build_model(self, model_cls: type[CausalLM], source: ModelSource, quant: QuantConfig | None) -> CausalLM:
        """Build a model on this worker's device, dtype and attention backend, and load its
        weights through `quant` (the target's model, or a proposer's draft)."""
        if quant is not None:
            reasons = quant.check(self.device, self.dtype)
            if reasons:
                raise ValueError(f"quantization {quant.name!r} cannot run here: {'; '.join(reasons)}")
            quant.bind(model_cls.packed_modules_mapping)
        ctx = self._model_context(source.hf_config)
        ctx.quant_config = quant
        with precision.matmul_precision(self.matmul_precision, self._dense_weights(source, quant)):
            with torch.device(self.device):
                model = model_cls(ctx)
            weights = source.weights()
            model.load_weights(quant.weights(weights, model) if quant is not None else weights)
            process_after_loading(model)
        return model.eval()

    def _dense_weights(self, source: ModelSource, quant: QuantConfig | None) -> torch.dtype | None:
        """The dtype `source`'s dense weights are created in (None: the compute dtype): a
        draft's own checkpoint decides for its weights, under the target's compute dtype."""
        if self.dtype != torch.float32:
            return None
        return dense_weight_dtype(self.config.model.dtype, source.hf_config, self.device.type, quant is not None)

    def _model_context(self, hf_config: Any) -> ModelContext:
        return ModelContext(hf_config=hf_config, dtype=self.dtype, device=self.device,
                            attention_backend=self.backend, kv_cache_dtype=self.config.cache.kv_cache_dtype,
                            block_size=self.block_size, extra=dict(self.config.plugin_options),
                            matmul_precision=self.matmul_precision, parallel=self.parallel,
                            max_model_len=self.max_model_len,
                            calculate_kv_scales=self.config.cache.calculate_kv_scales)

    def _metadata_builder(self, kv_spec: KVCacheSpec, what: str = "the proposer's attention layers"):
        """The metadata builder for a proposer's attention layers, which share the target's
        backend and cache dtype (their caches are allocated beside the target's)."""
        attn_spec = self._attention_spec(kv_spec)
        reasons = self.registry.backend_reasons(self.backend, attn_spec)
        if reasons:
            raise ValueError(f"{what} cannot run on the target's attention backend {self.backend.name}: "
                             f"{'; '.join(reasons)}")
        if self.backend.kv_cache_dtype(attn_spec) != self.kv_dtype:
            raise ValueError(f"{what} would keep a KV cache in {self.backend.kv_cache_dtype(attn_spec)}, "
                             f"the target in {self.kv_dtype}: give both the same dtype")
        return self.backend.builder_cls()(attn_spec).build

    def load_draft_model(self, path: str, quantization: str | None) -> DraftModel:
        """A proposer's model, built the way the target was (`ProposerContext.load_model`)."""
        from pagedllm.core.loader import open_model

        source = open_model(path, "auto", self.registry, self.config.plugin_options,
                            trust_remote_code=self.config.model.trust_remote_code,
                            download_dir=self.config.model.download_dir)
        model_cls = self.registry.model_class(list(getattr(source.hf_config, "architectures", None) or []))
        kv_spec = model_cls.kv_cache_spec(source.hf_config)
        build_metadata = self._metadata_builder(kv_spec, f"the draft model {path}")
        quant = _quant_config(quantization, source, self.registry, self.config.plugin_options)
        start = time.perf_counter()
        model = self._build_model(model_cls, source, quant)
        logger.info("loaded draft %s from %s in %.1fs", type(model).__name__, path, time.perf_counter() - start)
        runner = None if self.config.device.enforce_eager else self._graph_runner(self.registry, model)
        run = runner if runner is not None else (lambda layout, attn: model(layout.input_ids, layout.positions, attn))
        return DraftModel(model=model, hf_config=source.text_config, tokenizer=source.tokenizer,
                          kv_spec=kv_spec, build_metadata=build_metadata, run=run)

    def _proposer(self, spec: SpecDecodeConfig, source: ModelSource) -> SpecProposer:
        cls = self.registry.spec_method(spec.method)
        context = ProposerContext(config=spec, target=self.model, hf_config=source.text_config,
                                  tokenizer=source.tokenizer, device=self.device, dtype=self.dtype,
                                  max_model_len=self.max_model_len, block_size=self.block_size,
                                  load_model=self.load_draft_model, make_layout=self._layout,
                                  model_context=self._model_context, metadata_builder=self._metadata_builder)
        proposer = cls(context)
        layers = proposer.aux_hidden_state_layers
        if layers:
            self.model.set_aux_hidden_state_layers(tuple(layers))
        logger.info("speculative decoding: %s, %d draft tokens per step", spec.method, spec.num_speculative_tokens)
        return proposer

    def _allocate(self, spec: KVCacheSpec, layers: range | None = None) -> list[torch.Tensor]:
        """One cache tensor per layer, indexed by the model's layer number; the layers of
        other pipeline stages (outside `layers`) get an empty placeholder."""
        shape = self.backend.cache_shape(self.budget.num_blocks, self.block_size, spec)
        caches = self._layer_caches(spec, layers, lambda: zeroed(shape, self.kv_dtype, self.device))
        blocks = cpu_prefault_blocks(self.budget) if self.device.type == "cpu" else 0
        if blocks:
            start = time.perf_counter()
            written = prefault(caches, shape, self.backend.cache_shape(blocks, self.block_size, spec))
            logger.info("KV cache: the first %d blocks faulted in (%.1f MiB in %.2f s; PAGEDLLM_CPU_KV_PREFAULT_MB)",
                        blocks, written / (1 << 20), time.perf_counter() - start)
        return caches

    def _layer_caches(self, spec: KVCacheSpec, layers: range | None,
                      make: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
        """`make()` for each layer in `layers` (default all), an empty placeholder for the
        others (another pipeline stage's), indexed by the model's layer number."""
        layers = range(spec.num_layers) if layers is None else layers
        empty = torch.empty(0, dtype=self.kv_dtype, device=self.device)
        return [make() if i in layers else empty for i in range(spec.num_layers)]

    def _graph_runner(self, registry: PluginRegistry, model: torch.nn.Module | None = None) -> GraphRunner | None:
        """What replays captured steps instead of calling the model (CUDA graphs, CPU step
        replay), if any runs here with this attention backend."""
        runner_cls = registry.graph_runner(self.device, self.backend)
        if runner_cls is None:
            logger.info("graph capture: none runs here with %s; every step runs eagerly", self.backend.name)
            return None
        logger.info("graph capture: %s (--enforce-eager turns it off)", runner_cls.name)
        return runner_cls(self.model if model is None else model, self.backend)

    def _plan_memory(self, draft_spec: KVCacheSpec | None = None) -> KVBudget:
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        bytes_per_token = self.kv_spec.bytes_per_token(element, len(self.stage_layers))
        if draft_spec is not None:  # a proposer's layers share the target's block table
            bytes_per_token += draft_spec.bytes_per_token(element)
        cache = self.config.cache
        total = None
        if self.device.type == "cuda":
            available, source = self._profile_cuda(bytes_per_token)
            if cache.kv_cache_memory is None:
                total = torch.cuda.mem_get_info(self.device)[1]
        else:
            available, source = cpu_kv_bytes(cache.kv_cache_memory)
        held = tokens_held_per_seq(self.max_model_len, self.kv_window, self.max_num_batched_tokens, self.block_size)
        budget = plan_kv_cache(available, source, bytes_per_token, self.block_size, self.max_model_len,
                               self.config.scheduler.max_num_seqs, self.device.type == "cuda", held,
                               kv_element_size=element, total_bytes=total,
                               gpu_memory_utilization=cache.gpu_memory_utilization if total else None)
        world = self.parallel.world
        if world.size > 1:  # one block table serves every rank: the smallest rank's count
            fewest = world.min_int(budget.num_blocks)
            if fewest < budget.num_blocks:
                logger.info("KV cache: %d blocks on this rank, %d on the smallest: using %d",
                            budget.num_blocks, fewest, fewest)
                budget = dataclasses.replace(budget, num_blocks=fewest)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%s, %.2f GiB, %d bytes/token, dtype %s)",
                    budget.num_blocks, self.block_size, budget.num_tokens, source,
                    budget.num_blocks * self.block_size * bytes_per_token / GiB, bytes_per_token,
                    str(self.kv_dtype).replace("torch.", ""))
        return budget

    def _profile_cuda(self, bytes_per_token: int) -> tuple[int, str]:
        """Run one maximal step with a throw-away cache to learn the activation peak."""
        cache = self.config.cache
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory, "kv_cache_memory"
        num_tokens = min(self.max_num_batched_tokens, self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        spec = self.kv_spec
        shape = self.backend.cache_shape(num_blocks, self.block_size, spec)
        scratch = self._layer_caches(spec, self.stage_layers,
                                     lambda: torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        layout = self._layout([[0] * num_tokens], [0], [num_tokens], [list(range(num_blocks))])
        with torch.inference_mode():
            hidden = self._forward(layout, AttentionContext(self.builder.build(layout), scratch, dummy=True))
            if hidden is not None:
                self.model.compute_logits(hidden[-min(num_tokens, self.config.scheduler.max_num_seqs):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        scratch_bytes = sum(t.numel() * t.element_size() for t in scratch)
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        in_use_by_others = total - free - torch.cuda.memory_reserved()
        available = int(total * cache.gpu_memory_utilization) - (peak - scratch_bytes) - max(0, in_use_by_others)
        return available, (f"gpu_memory_utilization={cache.gpu_memory_utilization} of {total / GiB:.1f} GiB, "
                           f"peak {(peak - scratch_bytes) / GiB:.2f} GiB for weights and activations")

    # ------------------------------------------------------------------ one step

    def _layout(self, token_ids: list[list[int]], computed: list[int], num_new: list[int],
                block_ids: list[list[int]]) -> BatchLayout:
        bs = self.block_size
        num_new_np = np.asarray(num_new, dtype=np.int64)
        computed_np = np.asarray(computed, dtype=np.int64)
        qsl = np.zeros(len(num_new) + 1, dtype=np.int64)
        np.cumsum(num_new_np, out=qsl[1:])
        total = int(qsl[-1])
        req_of_token = np.repeat(np.arange(len(num_new)), num_new_np)
        positions = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1] - computed_np, num_new_np)
        max_blocks = max(len(b) for b in block_ids)
        tables = np.zeros((len(block_ids), max_blocks), dtype=np.int64)
        for i, ids in enumerate(block_ids):
            tables[i, :len(ids)] = ids
        slots = tables[req_of_token, positions // bs] * bs + positions % bs
        input_ids = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=total)
        seq_lens = computed_np + num_new_np
        dev = self.device
        qsl_t = torch.from_numpy(qsl.astype(np.int32))
        seq_t = torch.from_numpy(seq_lens.astype(np.int32))
        return BatchLayout(
            input_ids=torch.from_numpy(input_ids).to(dev), positions=torch.from_numpy(positions).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev), block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev),
            query_start_loc=qsl_t.to(dev), seq_lens=seq_t.to(dev), query_start_loc_cpu=qsl_t,
            seq_lens_cpu=seq_t, max_query_len=int(num_new_np.max()), max_seq_len=int(seq_lens.max()),
            block_size=bs)

    def _forward(self, layout: BatchLayout, attn: AttentionContext) -> torch.Tensor | None:
        """This rank's part of the model forward: a pipeline stage other than the first
        receives the previous stage's tensors, one other than the last hands its own to the
        next stage and returns None; the last stage returns the hidden states."""
        pp = self.parallel.pp
        intermediate = None
        if not pp.first:
            intermediate = IntermediateTensors(pp.recv_tensors(pp.rank - 1, self.device))
        if self.graph_runner is not None:
            hidden = self.graph_runner(layout, attn)
        elif intermediate is None:
            hidden = self.model(layout.input_ids, layout.positions, attn)
        else:
            hidden = self.model(layout.input_ids, layout.positions, attn, intermediate)
        if not pp.last:
            pp.send_tensors(hidden.tensors, pp.rank + 1)
            return None
        return hidden

    @torch.inference_mode()
    def run(self, msg: StepMessage) -> tuple[BatchLayout, torch.Tensor | None, list[torch.Tensor]]:
        """One step on this rank, from the message alone: bring the held requests up to
        date, run this rank's part of the forward, and compute the logits of the rows the
        message names (a collective over the tensor-parallel ranks of the last stage). The
        driver gets the hidden states (None under pipeline parallelism: they stay on the
        last stage) and the logits (sent to it from the last stage)."""
        tokens, tables = self.held.apply(msg)
        layout = self._layout(tokens, [s.num_computed_tokens for s in msg.scheduled],
                              [s.num_new_tokens for s in msg.scheduled], tables)
        hidden = self._forward(layout, AttentionContext(self.builder.build(layout), self.kv_caches))
        logits: list[torch.Tensor] = []
        if hidden is not None:
            final = hidden
            if self.proposer is not None and self.proposer.aux_hidden_state_layers:  # inner layers ride along
                final = hidden.chunk(1 + len(self.proposer.aux_hidden_state_layers), dim=-1)[0]
            logits = [self.model.compute_logits(final[torch.tensor(rows, device=self.device)])
                      for rows in msg.logit_rows]
        pp, parallel = self.parallel.pp, self.parallel
        if pp.size > 1 and msg.logit_rows:  # the last stage's first rank hands the logits to the driver
            if pp.last and parallel.tp.first:
                parallel.world.send_tensors({str(i): t for i, t in enumerate(logits)}, 0)
            elif parallel.is_driver:
                got = parallel.world.recv_tensors(parallel.world.size - parallel.tp.size, self.device)
                logits = [got[str(i)] for i in range(len(got))]
        return layout, hidden, logits

    def execute(self, out: SchedulerOutput, send: Any = None) -> StepResult:
        """The driver's step: the message every rank runs (`send` hands it to the others),
        then sampling, prompt logprobs and the proposer's view of the step."""
        entries = out.scheduled
        if self.proposer is not None:
            for request_id in out.preempted_ids:
                self.proposer.forget(request_id)
        ends = np.cumsum([e.num_new_tokens for e in entries])
        sampling = [i for i, e in enumerate(entries) if e.samples]
        verify = any(entries[i].spec_token_ids for i in sampling)
        prompt_rows = self._prompt_logprob_rows(entries, ends)
        if not sampling:
            sample_rows: list[int] = []
        elif not verify:
            sample_rows = [int(ends[i]) - 1 for i in sampling]
        else:  # a verify step: the rows of each request's next token and of its drafts
            sample_rows = [r for i in sampling for r in range(int(ends[i]) - 1 - len(entries[i].spec_token_ids),
                                                              int(ends[i]))]
        rows = [r for _, _, r in prompt_rows] + ([sample_rows] if sample_rows else [])
        msg = self.encoder.encode(out, rows)
        if send is not None:
            send(msg)
        layout, hidden, logits = self.run(msg)
        if self.proposer is not None and self.proposer.needs_target_step:
            aux: list[torch.Tensor] = []
            if self.proposer.aux_hidden_state_layers:
                hidden, *aux = hidden.chunk(1 + len(self.proposer.aux_hidden_state_layers), dim=-1)
            self._last_step = TargetStep(layout, hidden, aux, {e.request.request_id: i for i, e in enumerate(entries)},
                                         [e.request.all_token_ids for e in entries], [e.samples for e in entries])
            self.proposer.observe(self._last_step)
        prompt_logprobs = self._prompt_logprobs(entries, prompt_rows, logits)
        if not sampling:
            return StepResult({}, {}, prompt_logprobs)
        requests: list[Request] = [entries[i].request for i in sampling]
        if not verify:
            result: SamplerOutput = self.sampler(logits[-1], requests)
            sampled = {r.request_id: [t] for r, t in zip(requests, result.token_ids)}
            logprobs = {r.request_id: [lp] for r, lp in zip(requests, result.logprobs) if lp is not None}
            return StepResult(sampled, logprobs, prompt_logprobs)
        drafts = [entries[i].spec_token_ids for i in sampling]
        token_lists, logprob_lists = self.sampler.verify(logits[-1], requests, drafts)
        sampled = {r.request_id: ts for r, ts in zip(requests, token_lists)}
        logprobs = {r.request_id: lps for r, lps in zip(requests, logprob_lists) if r.params.logprobs is not None}
        return StepResult(sampled, logprobs, prompt_logprobs)

    def _prompt_logprob_rows(self, entries: Sequence[Any], ends: np.ndarray) -> list[tuple[int, int, list[int]]]:
        """For the requests asking prompt logprobs: (entry index, first prompt position
        scored, hidden rows) per slice of at most PROMPT_LOGPROBS_SLICE rows, so a long chunk
        never makes a chunk x vocab tensor. The row at position p scores prompt token p + 1;
        positions recorded before (a recompute after preemption) are skipped."""
        out = []
        for i, e in enumerate(entries):
            req = e.request
            if req.prompt_logprobs is None:
                continue
            first = max(e.num_computed_tokens, len(req.prompt_logprobs) - 1)  # positions scored
            last = min(e.num_computed_tokens + e.num_new_tokens, req.num_prompt_tokens - 1)
            start = int(ends[i]) - e.num_new_tokens
            for lo in range(first, last, PROMPT_LOGPROBS_SLICE):
                hi = min(last, lo + PROMPT_LOGPROBS_SLICE)
                out.append((i, lo, [p - e.num_computed_tokens + start for p in range(lo, hi)]))
        return out

    def _prompt_logprobs(self, entries: Sequence[Any], rows: list[tuple[int, int, list[int]]],
                         logits: list[torch.Tensor]) -> dict[str, list[tuple[int, Any]]]:
        """(prompt token, logprob entry) per position scored by this step's prompt rows
        (`_prompt_logprob_rows`, whose logits come first in `logits`)."""
        out: dict[str, list[tuple[int, Any]]] = {}
        for (i, lo, slice_rows), slice_logits in zip(rows, logits):
            req = entries[i].request
            targets = req.prompt_token_ids[lo + 1:lo + 1 + len(slice_rows)]
            found = logprob_entries(slice_logits.float(), torch.tensor(targets, device=self.device),
                                    [req.params.prompt_logprobs] * len(targets))
            out.setdefault(req.request_id, []).extend(zip(targets, found))
        return out

    @torch.inference_mode()
    def propose(self, appended: list[tuple[Request, list[int]]], block_ids: list[Sequence[int]],
                max_drafts: int | None = None, even: bool = True) -> dict[str, list[int]]:
        """Drafts for the requests that decode next: each with the tokens the step appended
        (the accepted drafts and the target's own token) and its KV block ids; none where
        none may be proposed. At most `max_drafts` per request (default k); with 0 the
        proposer still sees the step (with no room for drafts), so that what it keeps per
        request stays current. `even`: fill short proposals up to the longest (`_even_out`);
        off, only the proposals themselves (an acceptance probe)."""
        proposer = self.proposer
        if proposer is None or not appended:
            return {}
        step, self._last_step = self._last_step, None
        k = proposer.k if max_drafts is None else min(max_drafts, proposer.k)
        requests = [req for req, _ in appended]
        caps = []
        for req in requests:
            room = self.max_model_len - req.num_tokens - 1
            if req.params.max_tokens is not None:
                room = min(room, req.params.max_tokens - req.num_output_tokens - 1)
            caps.append(max(0, min(k, room)))
        batch = ProposalBatch(
            request_ids=[r.request_id for r in requests],
            token_ids=[r.all_token_ids for r in requests],
            num_prompt_tokens=[r.num_prompt_tokens for r in requests],
            num_new_tokens=[len(t) for _, t in appended],
            num_accepted=[len(t) - 1 for _, t in appended],
            max_drafts=caps,
            block_ids=block_ids,
            step=step)
        drafts = [list(d[:cap]) for d, cap in zip(proposer.propose(batch), caps)]
        if not even:
            return {rid: d for rid, d in zip(batch.request_ids, drafts) if d}
        return _even_out(batch, drafts, caps)

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        self.encoder.forget(request_id)
        if self.proposer is not None:
            self.proposer.forget(request_id)


def check_split(config: EngineConfig, source: ModelSource, registry: PluginRegistry) -> None:
    """Whether this model splits over the configured ranks (heads over tensor-parallel
    ranks, layers over stages): a ValueError / NotImplementedError saying what to change."""
    model_cls = registry.model_class(list(getattr(source.hf_config, "architectures", None) or []))
    p = config.parallel
    if not model_cls.supports_parallel:
        raise NotImplementedError(
            f"{model_cls.__name__} cannot be split over ranks yet (tensor_parallel_size={p.tensor_parallel_size}, "
            f"pipeline_parallel_size={p.pipeline_parallel_size}); run it on one rank")
    spec = model_cls.kv_cache_spec(source.hf_config)
    spec.for_tensor_parallel(p.tensor_parallel_size)
    stage_layers(spec.num_layers, p.pipeline_parallel_size, 0)


def _even_out(batch: ProposalBatch, drafts: list[list[int]], caps: list[int]) -> dict[str, list[int]]:
    """Give every request of the step as many drafts as the longest proposal (up to its
    cap), filling short ones with their last token: a verify step then has n x (1 + d)
    rows for one d, not one row count per mix of proposals, so captured steps (CPU step
    replay, CUDA graphs) replay instead of meeting a new shape nearly every step. A filler
    is verified like any draft (kept only where it is the target's token), so output is
    unchanged; it costs a query row, which a small batch's step hardly notices (SmolLM2
    on 2 Sapphire Rapids cores, 1 request: 17 ms for 1 row, 25 ms for 6)."""
    width = max((len(d) for d in drafts), default=0)
    if width == 0:
        return {}
    out = {}
    for rid, d, cap, ids in zip(batch.request_ids, drafts, caps, batch.token_ids):
        want = min(width, cap)
        if want:
            out[rid] = d + [d[-1] if d else ids[-1]] * (want - len(d))
    return out


def _requested_backend(config: EngineConfig) -> tuple[str | None, str]:
    from pagedllm.core import envs

    if config.device.attention_backend:
        return config.device.attention_backend, "from --attention-backend"
    value = envs.get("PAGEDLLM_ATTENTION_BACKEND")
    if value:
        return value, f"from {envs.source('PAGEDLLM_ATTENTION_BACKEND')}"
    return None, "auto-selected: the fastest that can run here"
