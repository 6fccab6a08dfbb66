"""Shared factories: tiny random Hugging Face models (fixed seed) with a real tokenizer."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run only interpreted, and the interpreter must be on before
# anything (a test module, or a library such as compressed-tensors) first imports triton.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Where the engine-parity tests build their engines: "cpu" (CI) or "cuda", which
# scripts/gpu_check.sh sets to run the same transformers-parity tests on a GPU.
TEST_DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"PAGEDLLM_TEST_DEVICE must be cpu or cuda, got {TEST_DEVICE!r}")
if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("PAGEDLLM_TEST_DEVICE=cuda but torch sees no CUDA device")
# the fast attention backend beside the TORCH reference in backend-parametrized tests
NATIVE_BACKEND = "CPU_ATTN" if TEST_DEVICE == "cpu" else "TRITON"
# a test of the CPU's own kernels or defaults (its CUDA counterpart, if any, is marked cuda)
cpu_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="checks the CPU's own kernels or defaults")


def report(line: str) -> None:
    """A measured figure a passing test states: appended to $PAGEDLLM_TEST_REPORT when set
    (scripts/gpu_check.sh collects them), else printed (shown with `pytest -s`)."""
    path = os.environ.get("PAGEDLLM_TEST_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    else:
        print(line)

def _limited_build(level: str, needs: set[str]):
    """The engine as PAGEDLLM_CPU_MAX_ISA=`level` runs it (the native kernels built for that
    level, the CPU's flags read without the rest): yields its library; skipped where this
    CPU lacks a flag in `needs`."""
    from pagedllm.ops.cpu import features, native

    if TEST_DEVICE != "cpu" or not native.switched_on():
        pytest.skip("the native CPU kernels are off")
    if not needs <= features.machine().flags:
        pytest.skip(f"this CPU has none of {', '.join(sorted(needs - features.machine().flags))}")
    limit = pytest.MonkeyPatch()
    limit.setenv("PAGEDLLM_CPU_MAX_ISA", level)
    features.detect.cache_clear()
    native.forget_kernels()
    try:
        lib = native.kernels()
        assert lib is not None, f"the {level} build of the native kernels failed"
        yield lib
    finally:
        limit.undo()
        features.detect.cache_clear()
        native.forget_kernels()


@pytest.fixture
def avx2_build():
    """The AVX2-only build (PAGEDLLM_CPU_MAX_ISA=avx2: no AVX-512, AMX or AVX-VNNI), what a Zen 3
    runs, so an AVX-512 machine's tests also take the AVX2 paths."""
    yield from _limited_build("avx2", {"avx2", "fma", "f16c"})


@pytest.fixture
def avx_vnni_build():
    """The AVX2 + AVX-VNNI build (PAGEDLLM_CPU_MAX_ISA=avx2_vnni), what an Alder Lake or Sierra
    Forest core runs."""
    yield from _limited_build("avx2_vnni", {"avx2", "fma", "f16c", "avx_vnni"})


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0123456789 and symbols #$%&*()[]{}.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

ARCHS = {
    "llama": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", tie_word_embeddings=True),
    "qwen2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config", tie_word_embeddings=False),
    "mistral": dict(cls="MistralForCausalLM", cfg="MistralConfig", tie_word_embeddings=False, sliding_window=None),
    "llama3-rope": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", tie_word_embeddings=False,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(cls="Qwen3ForCausalLM", cfg="Qwen3Config", tie_word_embeddings=False, head_dim=32),
}


def save_tokenizer(path: Path, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random model (fixed seed) saved as config.json + safetensors + tokenizer files."""
    import transformers

    spec = dict(ARCHS[arch])
    model_cls = getattr(transformers, spec.pop("cls"))
    config_cls = getattr(transformers, spec.pop("cfg"))
    settings = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    initializer_range=0.3, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    settings.update(spec)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Callable[..., Path]:
    """Factory: tiny_model_dir("qwen3") -> path of a cached random model of that architecture."""
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from pagedllm.core.config import default_model

    try:
        return default_model()
    except ValueError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def smollm2_float(tmp_path_factory) -> Path:
    """A float32 Hugging Face copy of the bundled SmolLM2 (its Q4_1 weights dequantized),
    made once per session: what the quantization tests quantize in each format."""
    from pagedllm.bench.hfcopy import make_hf_copy

    return make_hf_copy(out_dir=tmp_path_factory.mktemp("smollm2-hf"))
