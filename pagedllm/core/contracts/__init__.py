"""What plugins implement: with `core/hookspecs.py`, all a plugin author must read.

One module per plugin kind; every name is importable from here:

- `attention`: attention backends (`AttentionBackend`, its metadata builder and
  per-layer impl), the flattened batch they read (`BatchLayout`), `GraphSupport`;
- `quant`: quantizers (`QuantConfig` -> `LinearMethod` / `EmbeddingMethod` / `MoEMethod`
  per layer);
- `spec`: speculative proposers (`SpecProposer`, what they get: `ProposerContext`,
  `ProposalBatch`, `TargetStep`; the draft models they load: `DraftModel`);
- `model`: model architectures (`CausalLM`, `KVCacheSpec`, `ModelContext`) and
  checkpoint formats (`CheckpointFormat`: a file type such as GGUF that carries config,
  tokenizer and weights together);
- `logits`: per-request logits processors (`LogitsProcessorFactory` -> `LogitsProcessor`,
  the bitmask they fill: structured outputs and the like);
- `tools`: tool-call parsers (`ToolParser` -> `ParsedTools` of `ToolCall`s), text only;
- `reasoning`: reasoning parsers (`ReasoningParser`: text -> (reasoning, content); the
  stream helper `ReasoningDelta`), text only;
- `runtime`: implementations of the layer ops (`OpImpl`, see `pagedllm.ops`) and graph
  runners (`GraphRunner`: capture a step's forward once per shape, replay it after).

Data crossing a boundary is a frozen dataclass; behaviour is a small ABC.
"""

from pagedllm.core.contracts.attention import BatchLayout, AttentionSpec, AttentionMetadataBuilder, AttentionImpl, GraphSupport, AttentionBackend, AttentionContext, KV_CACHE_TORCH_DTYPES, kv_cache_torch_dtype
from pagedllm.core.contracts.quant import LinearMethod, EmbeddingMethod, MoEMethod, QuantConfig, skip_matches
from pagedllm.core.contracts.spec import CORE_KEYS as SPEC_CORE_KEYS, DraftModel, ProposalBatch, ProposerContext, SpecDecodeConfig, SpecProposer, TargetStep
from pagedllm.core.contracts.model import KVCacheSpec, ModelContext, CausalLM, CheckpointFormat, IntermediateTensors
from pagedllm.core.contracts.runtime import OpImpl, GraphRunner
from pagedllm.core.contracts.logits import LogitsProcessor, LogitsProcessorContext, LogitsProcessorFactory, bitmask_bias, bitmask_empty, bitmask_words, pack_bitmask, unpack_bitmask
from pagedllm.core.contracts.tools import ParsedTools, ToolCall, ToolParser, ToolSpec
from pagedllm.core.contracts.reasoning import ReasoningDelta, ReasoningParser

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "BatchLayout",
    "CausalLM",
    "CheckpointFormat",
    "EmbeddingMethod",
    "GraphRunner",
    "GraphSupport",
    "IntermediateTensors",
    "KVCacheSpec",
    "KV_CACHE_TORCH_DTYPES",
    "LinearMethod",
    "LogitsProcessor",
    "LogitsProcessorContext",
    "LogitsProcessorFactory",
    "ParsedTools",
    "ReasoningDelta",
    "ReasoningParser",
    "ToolCall",
    "ToolParser",
    "ToolSpec",
    "bitmask_bias",
    "bitmask_empty",
    "bitmask_words",
    "pack_bitmask",
    "unpack_bitmask",
    "ModelContext",
    "MoEMethod",
    "OpImpl",
    "QuantConfig",
    "DraftModel",
    "ProposalBatch",
    "ProposerContext",
    "SPEC_CORE_KEYS",
    "SpecDecodeConfig",
    "SpecProposer",
    "TargetStep",
    "kv_cache_torch_dtype",
    "skip_matches",
]
