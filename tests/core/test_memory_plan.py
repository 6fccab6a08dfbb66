"""The KV-cache arithmetic the engine's start-up check and `pagedllm plan` share
(pagedllm/core/memory.py), against numbers computed by hand in the comments."""

from __future__ import annotations

import pytest

from pagedllm.core.contracts.model import KVCacheSpec
from pagedllm.core.memory import (GiB, blocks_per_sequence, kv_element_size, kv_remedies, longest_sequence_that_fits,
                                  not_enough_memory, plan_kv_cache, rank_bytes_per_token, sequence_bytes,
                                  sequences_that_fit, tokens_held_per_seq, utilization_needed)

# Qwen3-235B-A22B's attention: 94 layers, 64 query heads, 4 KV heads of 128
QWEN3_235B = KVCacheSpec(num_layers=94, num_heads=64, num_kv_heads=4, head_size=128)
# DeepSeek-V3's MLA: 61 layers, one latent of kv_lora_rank 512 + qk_rope_head_dim 64
DEEPSEEK_V3 = KVCacheSpec(num_layers=61, num_heads=128, num_kv_heads=1, head_size=576, latent_size=576,
                          value_size=512)


def test_kv_element_size_follows_the_cache_dtype():
    assert kv_element_size("auto", 2) == 2
    assert kv_element_size("auto", 4) == 4
    assert [kv_element_size(d, 2) for d in ("fp8", "fp8_e4m3", "fp8_e5m2")] == [1, 1, 1]


def test_bytes_per_token_per_rank_tensor_and_pipeline_parallel():
    # 2 (K and V) x 94 layers x 4 KV heads x 128 x 2 bytes
    assert rank_bytes_per_token(QWEN3_235B, 2) == 192_512
    # TP=2: 2 KV heads per rank; fp8: 1 byte -> 2 x 94 x 2 x 128 = 48128
    assert rank_bytes_per_token(QWEN3_235B, 1, tp_size=2) == 48_128
    assert rank_bytes_per_token(QWEN3_235B, 2, tp_size=2) == 96_256
    # TP=8 > 4 KV heads: each rank keeps one (replicated) KV head: 2 x 94 x 1 x 128 x 2
    assert rank_bytes_per_token(QWEN3_235B, 2, tp_size=8) == 48_128
    # a pipeline stage of 47 layers at TP=2 fp8: 2 x 47 x 2 x 128
    assert rank_bytes_per_token(QWEN3_235B, 1, tp_size=2, layers=47) == 24_064
    # MLA: 61 x 576 x 2 bytes, the same on every tensor-parallel rank
    assert rank_bytes_per_token(DEEPSEEK_V3, 2) == 70_272
    assert rank_bytes_per_token(DEEPSEEK_V3, 2, tp_size=8) == 70_272
    assert rank_bytes_per_token(DEEPSEEK_V3, 1) == 35_136


def test_a_32k_sequence_of_qwen3_235b_at_tp2():
    # the seed figures: 48128 x 32768 = 1,577,058,304 bytes (about 1.6 GB) in fp8, twice in bf16
    assert sequence_bytes(48_128, 16, 32_768) == 1_577_058_304
    assert sequence_bytes(96_256, 16, 32_768) == 3_154_116_608
    assert blocks_per_sequence(32_768, 16) == 2048
    assert blocks_per_sequence(33, 16) == 3  # a partial block is a whole block
    assert sequence_bytes(10, 16, 33) == 480


def test_sequences_and_lengths_that_fit():
    # 10 GiB / (48128 x 16 = 770048 bytes a block) = 13943 blocks; / 2048 blocks a sequence = 6
    assert sequences_that_fit(10 * GiB, 48_128, 16, 32_768) == 6
    assert sequences_that_fit(-5, 48_128, 16, 32_768) == 0
    # 100 whole blocks of 1024 x 16 bytes and change: 1600 tokens
    assert longest_sequence_that_fits(100 * 1024 * 16 + 5, 1024, 16) == 1600
    assert longest_sequence_that_fits(1024 * 16 - 1, 1024, 16) == 0


def test_tokens_held_by_a_windowed_model():
    assert tokens_held_per_seq(32_768, None, 8192, 16) == 32_768
    assert tokens_held_per_seq(32_768, 4096, 2048, 16) == 4096 + 2048 + 16
    assert tokens_held_per_seq(4000, 4096, 2048, 16) == 4000


def test_utilization_needed():
    # 4 GiB more of 80 GiB: 0.9 + 0.05
    assert utilization_needed(80 * GiB, 0.9, 4 * GiB) == 0.95
    # 1 byte more still needs the next hundredth
    assert utilization_needed(80 * GiB, 0.9, 1) == 0.91
    assert utilization_needed(80 * GiB, 0.9, 0) == 0.9
    # 8.1 GiB more: 0.9 + 0.10125 > 1
    assert utilization_needed(80 * GiB, 0.9, int(8.1 * GiB)) is None


def test_plan_kv_cache_keeps_its_call_and_its_cap():
    budget = plan_kv_cache(10 * GiB, "test", 1024, 16, 64, 2, False, None)
    assert budget.num_blocks == 8  # 2 sequences x 4 blocks
    windowed = plan_kv_cache(10 * GiB, "test", 1024, 16, 4096, 2, False, 64)
    assert windowed.num_blocks == 8  # tokens_held_per_seq=64: 4 blocks a sequence


def test_the_error_gives_the_numbers_it_can():
    # 10 GiB for 32 GiB (32768 tokens x 1 MiB): 10 GiB / 16 MiB a block = 640 blocks = 10240 tokens
    with pytest.raises(ValueError) as err:
        plan_kv_cache(10 * GiB, "gpu", 1 << 20, 16, 32_768, 4, True, kv_element_size=2, total_bytes=80 * GiB,
                      gpu_memory_utilization=0.9)
    msg = str(err.value)
    assert "needs 32.000 GiB (34359738368 bytes) but 10.000 GiB" in msg
    assert "1) lower --max-model-len to 10240 (now 32768)" in msg
    # fp8: 8 MiB a block, 1280 blocks; a sequence needs 2048
    assert "3) use --kv-cache-dtype fp8 (1 byte per element instead of 2): 0 sequences of 32768 tokens fit" in msg
    # 22 GiB short; 1.0 of 80 GiB gives 8 GiB more: 14 GiB short still
    assert "6) raise --gpu-memory-utilization (now 0.9): even 1.0 leaves 14.00 GiB too little" in msg
    order = ["--max-model-len", "--max-num-seqs", "--kv-cache-dtype fp8", "tensor parallelism", "quantize",
             "--gpu-memory-utilization"]
    positions = [msg.index(s) for s in order]
    assert positions == sorted(positions), msg


def test_the_utilization_that_is_enough():
    # 30 GiB for 32 GiB on 80 GiB at 0.9: 2 GiB short -> 0.9 + 0.025 = 0.925 -> 0.93
    with pytest.raises(ValueError, match=r"raise --gpu-memory-utilization to 0\.93 \(now 0\.9\)"):
        plan_kv_cache(30 * GiB, "gpu", 1 << 20, 16, 32_768, 4, True, total_bytes=80 * GiB,
                      gpu_memory_utilization=0.9)


def test_cpu_and_explicit_cache_size_remedies():
    remedies = kv_remedies(30_000, "default 4 GiB", 1024, 16, 64, 2, False, 64, kv_element_size=2)
    assert [r.key for r in remedies] == ["max_model_len", "max_num_seqs", "kv_cache_dtype", "tensor_parallel_size",
                                         "quantization", "memory"]
    assert remedies[0].text == "lower --max-model-len to 16 (now 64)"  # 30000 // 16384 = 1 block
    # 64 tokens x 1024 bytes = 65536 bytes = 0.0000610 GiB -> 0.01
    assert remedies[5].text == "give the cache more memory (--kv-cache-memory 65536 or PAGEDLLM_CPU_KVCACHE_SPACE=0.01)"
    # fp8: 512 bytes a token, 8192 a block: 3 blocks of the 4 needed
    assert remedies[2].fits is False
    given = kv_remedies(1000, "kv_cache_memory", 1024, 16, 64, 2, True, 64)
    assert given[5].text == "raise --kv-cache-memory to 65536 (0.06 MiB)"
    assert given[0].fits is False and "no length fits" in given[0].text


def test_not_enough_memory_keeps_its_old_signature():
    msg = not_enough_memory(2 * GiB, GiB, 4096, False, "default 4 GiB")
    assert "max_model_len=4096" in msg and "1) lower --max-model-len (now 4096)" in msg
    assert "6) give the cache more memory (--kv-cache-memory or PAGEDLLM_CPU_KVCACHE_SPACE)" in msg
