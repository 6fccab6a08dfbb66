"""FP8 under tensor and expert parallelism: tiny checkpoints on 2 gloo ranks, greedy over a
batched prefill and 8 decode steps (tests/_rank_model.py's loop, through the checkpoint's
quantizer).

Scales that round every activation as one rank does (static input scales, 128x128-style
block scales split by whole blocks) must give one rank's greedy tokens and logits (up to
summation order). Under row parallel with dynamic per-token activation scales each rank
quantizes its own slice of the activations (vLLM does the same), and on these random tiny
models a different fp8 rounding of the activations moves the logits by O(1) (one rank's
fp8 run already decodes other tokens than the float model): those cases are checked
against transformers on the dequantized weights with each projection's input rounded as
the ranks round it (per token; per token and rank slice for o_proj / down_proj), teacher
forced on the tokens the ranks decoded, as tests/plugins/quant/test_fp8.py checks one rank.
Below the whole models, one layer's part of each checkpoint tensor on a given rank, and
the refusals of parts that cut a scale block."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm.core.parallel import Group, ParallelLayout, ParallelState
from pagedllm.plugins.models.layers import Linear, load_shard
from pagedllm.plugins.quant.fp8 import FP8, Fp8Config
from tests._checkpoints import LINEAR, split_linears, write_pair
from tests._distributed import run_ranks
from tests._fp8_quant import FP8_MAX, fp8_checkpoint
from tests._rank_fp8 import generate_quantized
from tests._rank_model import PROMPTS, STEPS

TINY_MOE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=512, initializer_range=0.3, bos_token_id=0, eos_token_id=1,
                pad_token_id=1, tie_word_embeddings=False)
TP = 2
ROW_PARALLEL = ("o_proj", "down_proj")  # the layers whose input each rank holds a slice of

# name -> (float model, fp8_checkpoint kwargs; None: `--quantization fp8` on the float checkpoint)
ALIGNED = {  # against one rank
    "per-tensor-static": ("llama", {"static_ids": PROMPTS[0]}),
    "block-16": ("llama", {"block": (16, 16)}),
    "qwen3moe-block-16": ("qwen3moe", {"block": (16, 16)}),
}
DYNAMIC = {  # against transformers with the ranks' activation rounding
    "per-tensor-dynamic": ("llama", {}),
    "flag-fp8": ("llama", None),
    "qwen3moe-per-tensor": ("qwen3moe", {}),
    "qwen3moe-flag-fp8": ("qwen3moe", None),
}
# compressed-tensors W8A8 (written by the library itself, see test_compressed_tensors.py):
# name -> write_checkpoint kwargs; dynamic per-token activations, fp8 or int8
HAVE_CT = importlib.util.find_spec("compressed_tensors") is not None
COMPRESSED = {
    "ct-fp8-channel": dict(bits=8, strategy="channel", fmt="float-quantized", kind="float", activations="token"),
    "ct-int8-channel": dict(bits=8, strategy="channel", fmt="int-quantized", activations="token"),
    "ct-int8-tensor": dict(bits=8, strategy="tensor", fmt="int-quantized", activations="token"),
} if HAVE_CT else {}
CASES = {**ALIGNED, **DYNAMIC, **{n: ("llama", kw) for n, kw in COMPRESSED.items()}}
EP_CASES = ("qwen3moe-per-tensor", "qwen3moe-block-16", "qwen3moe-flag-fp8")
# log-probabilities against one rank: only the summation order differs, but an activation
# a hair from an fp8 rounding midpoint may then round the other way (measured: max 3e-3)
ALIGNED_ATOL = 1e-2
ALIGNED_MEDIAN_ATOL = 1e-5
EMULATED_MEDIAN_ATOL = 1e-4  # as test_fp8.py: the same fp8 rounding on both sides
EMULATED_MEAN_ATOL = 0.05  # an activation a hair from a rounding midpoint may round the other way


def split_row_reference(src, ref) -> None:
    """`ref`: `src` with each projection's weight rounded as `--quantization fp8` on TP
    ranks rounds it: one scale per output row of the rank's part (row-parallel layers:
    per row and rank slice of the input; an expert's down_proj is quantized over its whole
    rows before its columns are split, see fp8_moe.py)."""
    quant, dense, linears = split_linears(src)
    for name, _prefix, w in linears:
        parts = TP if name.split(".")[-2] in ROW_PARALLEL and ".experts." not in name else 1
        shaped = w.view(w.shape[0], parts, -1)
        scale = (shaped.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        dense[name] = ((shaped / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).view_as(w)
    write_pair(src, ref.parent / "unused", ref, quant, dense, {})


@pytest.fixture(scope="module", autouse=True)
def w8a8():
    """The W8A8 cases quantize activations as a GPU would (on the CPU FP8 runs weight-only
    by default, see fp8.py; the weight-only cases below unset this); spawned ranks inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_FP8_ACTIVATIONS", "fp8")
        yield


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[str, str | None, str]]:
    """name -> (checkpoint dir, --quantization flag, dequantized float reference dir)."""
    from tests._models import save_hf_model

    moe = save_hf_model(tmp_path_factory.mktemp("qwen3moe"), "Qwen3MoeForCausalLM", "Qwen3MoeConfig", TINY_MOE)
    floats = {"llama": tiny_model_dir("llama"), "qwen3moe": moe}
    out = {}
    for name, (model, kwargs) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        if kwargs is None:
            split_row_reference(floats[model], root / "ref")
            out[name] = (str(floats[model]), "fp8", str(root / "ref"))
        elif name in COMPRESSED:
            from tests.plugins.quant.test_compressed_tensors import write_checkpoint

            write_checkpoint(floats[model], root / "ct", root / "ref", **kwargs)
            out[name] = (str(root / "ct"), None, str(root / "ref"))
        else:
            fp8_checkpoint(floats[model], root / "fp8", root / "ref", **kwargs)
            out[name] = (str(root / "fp8"), None, str(root / "ref"))
    return out


def on_ranks(layout: ParallelLayout, checkpoints: dict, names) -> dict[str, list[dict]]:
    cases = [checkpoints[n][:2] for n in names]
    per_rank = (run_ranks(generate_quantized, layout, cases) if layout.world_size > 1
                else [generate_quantized(ParallelState.single(), cases)])
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def one_rank(checkpoints) -> dict[str, dict]:
    return {name: ranks[0] for name, ranks in on_ranks(ParallelLayout(1, 1), checkpoints, list(CASES)).items()}


@pytest.fixture(scope="module")
def two_ranks(checkpoints) -> dict[str, list[dict]]:
    return on_ranks(ParallelLayout(TP, 1), checkpoints, list(CASES))


@pytest.fixture(scope="module")
def expert_parallel(checkpoints) -> dict[str, list[dict]]:
    return on_ranks(ParallelLayout(TP, 1, enable_expert_parallel=True), checkpoints, EP_CASES)


WEIGHT_ONLY = [n for n in ("per-tensor-dynamic", "flag-fp8", "qwen3moe-per-tensor", "qwen3moe-flag-fp8", "ct-fp8-channel") if n in CASES]


@pytest.fixture(scope="module")
def weight_only(checkpoints) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """(one rank, two ranks) with FP8's CPU default, weight-only: no activation rounding,
    so the dynamic layouts too must decode what one rank does."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PAGEDLLM_FP8_ACTIVATIONS")
        one = {n: r[0] for n, r in on_ranks(ParallelLayout(1, 1), checkpoints, WEIGHT_ONLY).items()}
        return one, on_ranks(ParallelLayout(TP, 1), checkpoints, WEIGHT_ONLY)


def log_probs(result: dict) -> torch.Tensor:
    return torch.log_softmax(torch.from_numpy(result["logits"]).double(), -1)  # [steps + 1, prompts, vocab]


def assert_same_as_one_rank(name: str, ranks: list[dict], ref: dict) -> None:
    assert all(len(set(seq)) > 3 for seq in ref["tokens"]), f"{name}: a degenerate reference proves nothing"
    want = log_probs(ref)
    for rank, got in enumerate(ranks):
        assert got["tokens"] == ref["tokens"], f"{name} rank {rank}"
        diff = log_probs(got) - want
        torch.testing.assert_close(diff, torch.zeros_like(diff), atol=ALIGNED_ATOL, rtol=0,
                                   msg=lambda m, rank=rank: f"{name} rank {rank}: {m}")
        assert diff.abs().median() < ALIGNED_MEDIAN_ATOL, f"{name} rank {rank}: median {diff.abs().median():.2e}"


def rank_rounding_hook(name: str, in_features: int, int8: bool = False):
    """A forward pre-hook rounding a projection's input to fp8 (or symmetric int8) as the
    TP ranks do: per token, and per rank slice of the input for a row-parallel layer."""
    parts = TP if name.split(".")[-1] in ROW_PARALLEL else 1

    def hook(_module, inputs):
        x = inputs[0]
        shaped = x.reshape(*x.shape[:-1], parts, in_features // parts)
        if int8:
            scale = (shaped.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-12)
            return (((shaped / scale).round().clamp(-128, 127) * scale).reshape(x.shape),)
        scale = (shaped.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return (((shaped / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).reshape(x.shape),)
    return hook


def assert_matches_rank_rounding(name: str, ranks: list[dict], ref_dir: str, round_inputs: bool = True) -> None:
    """transformers on the dequantized weights, inputs rounded as the ranks round them
    (unless `round_inputs` is False: weight-only), teacher-forced on the ranks' tokens: the
    same log-probabilities, and the ranks' tokens are its argmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    for module_name, module in model.named_modules():
        if round_inputs and isinstance(module, torch.nn.Linear) and LINEAR.match(module_name + ".weight"):
            module.register_forward_pre_hook(rank_rounding_hook(module_name, module.in_features,
                                                                int8=name.startswith("ct-int8")))
    first = ranks[0]
    assert all(len(set(seq)) > 3 for seq in first["tokens"]), f"{name}: degenerate tokens prove nothing"
    ours = log_probs(first)
    theirs = []
    with torch.no_grad():
        for i, (prompt, tokens) in enumerate(zip(PROMPTS, first["tokens"])):
            logits = model(torch.tensor([list(prompt) + tokens[:-1]])).logits[0, len(prompt) - 1:]
            theirs.append(torch.log_softmax(logits.double(), -1))
    theirs = torch.stack(theirs, dim=1)  # [steps + 1, prompts, vocab]
    for rank, got in enumerate(ranks):
        assert got["tokens"] == first["tokens"], f"{name}: rank {rank} sampled other tokens than rank 0"
    diff = (ours - theirs).abs()
    assert diff.median().item() < EMULATED_MEDIAN_ATOL, f"{name}: median log-probability diff {diff.median():.2e}"
    assert diff.mean().item() < EMULATED_MEAN_ATOL, f"{name}: mean log-probability diff {diff.mean():.2e}"
    picked = theirs.argmax(-1).T.tolist()
    assert picked == first["tokens"], f"{name}: the ranks decoded {first['tokens']}, transformers' argmax {picked}"


def assert_holds_its_half(name: str, ranks: list[dict], whole: dict) -> None:
    for rank, got in enumerate(ranks):  # each rank holds half the q/k/v rows and the o_proj input, in fp8
        held = got["held"]
        assert held["self_attn.qkv_proj"]["sizes"] == [s // 2 for s in whole["self_attn.qkv_proj"]["sizes"]]
        assert held["self_attn.o_proj"]["input"] == whole["self_attn.o_proj"]["input"] // 2
        assert held["self_attn.o_proj"]["kind"] == whole["self_attn.o_proj"]["kind"], f"{name} rank {rank}"


@pytest.mark.parametrize("name", list(ALIGNED))
def test_aligned_scales_on_two_ranks_decode_what_one_rank_does(name, two_ranks, one_rank):
    ref = one_rank[name]
    assert len(ref["tokens"]) == len(PROMPTS) and len(ref["tokens"][0]) == STEPS + 1
    assert_same_as_one_rank(name, two_ranks[name], ref)
    assert_holds_its_half(name, two_ranks[name], ref["held"])


@pytest.mark.parametrize("name", list(DYNAMIC))
def test_dynamic_scales_on_two_ranks_round_each_ranks_slice(name, two_ranks, one_rank, checkpoints):
    assert_matches_rank_rounding(name, two_ranks[name], checkpoints[name][2])
    assert_holds_its_half(name, two_ranks[name], one_rank[name]["held"])


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_weight_only_fp8_on_two_ranks_decodes_what_one_rank_does(name, weight_only, checkpoints):
    """`--quantization fp8` rounds each rank's part of a row-parallel weight with its own
    row scales (split_row_reference): that one is held to transformers on those weights."""
    one, two = weight_only
    assert all("W8A16" in r["held"]["self_attn.o_proj"]["kind"] for r in two[name]), two[name][0]["held"]
    if checkpoints[name][1] == "fp8":
        assert_matches_rank_rounding(name, two[name], checkpoints[name][2], round_inputs=False)
    else:
        assert_same_as_one_rank(name, two[name], one[name])
    assert_holds_its_half(name, two[name], one[name]["held"])


@pytest.mark.skipif(not HAVE_CT, reason="needs the compressed-tensors library to write its checkpoints")
@pytest.mark.parametrize("name", list(COMPRESSED) or ["ct"])
def test_compressed_tensors_w8a8_on_two_ranks_round_each_ranks_slice(name, two_ranks, one_rank, checkpoints):
    assert_matches_rank_rounding(name, two_ranks[name], checkpoints[name][2])
    assert_holds_its_half(name, two_ranks[name], one_rank[name]["held"])


@pytest.mark.parametrize("name", [n for n, (model, _) in CASES.items() if model == "qwen3moe"])
def test_experts_are_split_along_the_intermediate_size(name, two_ranks, one_rank):
    whole = one_rank[name]["held"]
    for got in two_ranks[name]:
        experts = got["held"]["experts"]
        w13, w2 = whole["experts"]["w13_weight"], whole["experts"]["w2_weight"]
        assert experts["w13_weight"] == (w13[0], w13[1] // 2, w13[2])  # every expert, half its gate and up rows
        assert experts["w2_weight"] == (w2[0], w2[1], w2[2] // 2)


@pytest.mark.parametrize("name", EP_CASES)
def test_expert_parallel_holds_half_the_experts(name, expert_parallel, one_rank, checkpoints):
    ranks, ref = expert_parallel[name], one_rank[name]
    if name in ALIGNED:
        assert_same_as_one_rank(name, ranks, ref)
    else:
        assert_matches_rank_rounding(name, ranks, checkpoints[name][2])
    whole = ref["held"]["experts"]
    for got in ranks:  # half the experts, each whole, scales included
        held = got["held"]["experts"]
        assert set(held) == set(whole)
        assert all(held[n] == (whole[n][0] // 2, *whole[n][1:]) for n in whole), held


# ---------------------------------------------------------------- layers on one rank

def rank_of(rank: int, size: int = 2) -> Group:
    """A group's view from `rank` (building and loading call no collective)."""
    return Group(list(range(size)), rank)


def fp8_tensor(rows: int, cols: int, seed: int) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 50).to(FP8)


def test_block_scales_split_by_whole_blocks():
    cfg = Fp8Config(serialized=True, static=False, block=(2, 4), skip=[])
    w = fp8_tensor(8, 16, 0)
    scales = torch.arange(4 * 4, dtype=torch.float32).view(4, 4)  # [8 / 2, 16 / 4]
    row = Linear(16, 8, quant_config=cfg, parallel="row", tp=rank_of(1))
    load_shard(row.weight, w, None)
    load_shard(row.weight_scale_inv, scales, None)
    assert torch.equal(row.weight.view(torch.uint8), w[:, 8:].view(torch.uint8))
    assert torch.equal(row.weight_scale_inv, scales[:, 2:])  # the input blocks 2, 3
    col = Linear(16, [4, 4], quant_config=cfg, parallel="column", tp=rank_of(1))
    for shard, rows in ((0, slice(0, 4)), (1, slice(4, 8))):
        load_shard(col.weight, w[rows], shard)
        load_shard(col.weight_scale_inv, scales[rows.start // 2:rows.stop // 2], shard)
    assert torch.equal(col.weight.view(torch.uint8), torch.cat([w[2:4], w[6:8]]).view(torch.uint8))
    assert torch.equal(col.weight_scale_inv, torch.cat([scales[1:2], scales[3:4]]))


def test_per_tensor_and_static_scales_are_whole_on_every_rank():
    cfg = Fp8Config(serialized=True, static=True, block=None, skip=[])
    for parallel in ("column", "row"):
        layer = Linear(8, [4, 4], quant_config=cfg, parallel=parallel, tp=rank_of(1)) if parallel == "column" \
            else Linear(8, 4, quant_config=cfg, parallel=parallel, tp=rank_of(1))
        for shard in (range(2) if parallel == "column" else (None,)):
            load_shard(layer.weight_scale, torch.tensor(0.5 + (shard or 0)), shard)
            load_shard(layer.input_scale, torch.tensor([0.25]), shard)
        assert layer.weight_scale.tolist() == ([0.5, 1.5] if parallel == "column" else [0.5])
        assert layer.input_scale.tolist()[0] == 0.25


def test_channel_scales_follow_the_rows():
    from pagedllm.plugins.quant.fp8 import Fp8LinearMethod

    class Channel(Fp8Config):
        def linear_method(self, prefix):
            return Fp8LinearMethod(self, channel_scales=True)

    cfg = Channel(serialized=True, static=False, block=None, skip=[])
    scale = torch.arange(6, dtype=torch.float32).view(6, 1)
    col = Linear(4, 6, quant_config=cfg, parallel="column", tp=rank_of(1))
    load_shard(col.weight_scale, scale, 0)
    assert torch.equal(col.weight_scale, scale[3:])
    row = Linear(4, 6, quant_config=cfg, parallel="row", tp=rank_of(1))
    load_shard(row.weight_scale, scale, None)
    assert torch.equal(row.weight_scale, scale)


def test_parts_that_cut_a_scale_block_are_refused():
    cfg = Fp8Config(serialized=True, static=False, block=(32, 32), skip=[])
    Linear(64, [64, 32, 32], quant_config=cfg, parallel="column")  # one rank: whole blocks
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 gives this rank \[32, 16, 16\] output rows, "
                                         r"not whole weight blocks of 32 rows"):
        Linear(64, [64, 32, 32], quant_config=cfg, parallel="column", tp=rank_of(0))
    with pytest.raises(ValueError, match=r"gives this rank 16 input columns, not whole weight blocks of 32"):
        Linear(32, 64, quant_config=cfg, parallel="row", tp=rank_of(1))


def test_moe_block_parts_that_cut_a_scale_block_are_refused():
    from pagedllm.plugins.models.moe import FusedMoE
    from tests import _rank_moe as rm

    cfg = Fp8Config(serialized=True, static=False, block=(16, 16), skip=[])
    tp = rm.make_context(rm.fake_state(ParallelLayout(2, 1), 0), cfg)
    FusedMoE(tp, 8, 2, 32, 32, rm.PREFIX, renormalize=True)  # 16 per rank: whole blocks
    with pytest.raises(ValueError, match=r"moe_intermediate_size 8 \(per rank, over tensor_parallel_size=2\) "
                                         r"is not a multiple of the weight block size 16"):
        FusedMoE(tp, 8, 2, 32, 16, rm.PREFIX, renormalize=True)
    ep = rm.make_context(rm.fake_state(ParallelLayout(2, 1, enable_expert_parallel=True), 0), cfg)
    FusedMoE(ep, 8, 2, 32, 16, rm.PREFIX, renormalize=True)  # whole experts: their blocks are whole
