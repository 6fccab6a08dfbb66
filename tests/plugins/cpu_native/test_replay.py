"""Step replay (pagedllm/plugins/cpu_native/replay.py): recorded decode steps give exactly what
eager steps give, with or without torch ops between the kernels; forwards whose Python
reads tensor values stay eager; a bad replay turns replay off; --enforce-eager never records."""

from __future__ import annotations

import pytest

from pagedllm.ops.cpu import native
from pagedllm.plugins.cpu_native import replay

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")

# different lengths, and one request stops early: the batch shrinks from 3 rows to 2
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 61, 12, 33], [301, 2, 77], [9] * 20]
MAX_TOKENS = [12, 12, 5]


def generate(model_dir, **kwargs):
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory=1 << 22, **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                 for o in outputs]


@pytest.fixture(autouse=True)
def keep_every_graph(monkeypatch):
    """Correctness tests keep graphs with torch ops even where a replay timed slower
    (test_a_slower_replay_stays_eager covers the timing rule)."""
    monkeypatch.setattr(replay, "DROP_SLOWER", False)


@pytest.fixture
def replays(monkeypatch):
    """Counts StepGraph.replay calls."""
    count = {"n": 0}
    original = replay.StepGraph.replay

    def counted(self, inputs):
        count["n"] += 1
        return original(self, inputs)

    monkeypatch.setattr(replay.StepGraph, "replay", counted)
    return count


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # qwen2: q/k/v biases, added inside the GEMM
def test_replayed_steps_equal_eager_steps_bit_for_bit(tiny_model_dir, replays, arch):
    model_dir = tiny_model_dir(arch)
    eager_llm, eager = generate(model_dir, enforce_eager=True)
    assert eager_llm.engine.worker.graph_runner is None, "--enforce-eager must not set up step replay"
    assert replays["n"] == 0
    llm, got = generate(model_dir)
    replayer = llm.engine.worker.graph_runner
    assert isinstance(replayer, replay.StepReplayer) and not replayer.off
    graphs = [g for g in replayer.graphs.values() if g is not None]
    assert {g.output.shape[0] for g in graphs} == {3, 2}, "the 3-row and 2-row decode steps were not recorded"
    assert all(g.verified for g in graphs), "a graph was never checked against an eager run"
    # 4 decode steps of 3 rows and 7 of 2 rows; one warm-up of all, then per shape one recorded step
    assert replays["n"] >= 8, f"only {replays['n']} steps were replayed"
    assert got == eager, "replayed steps differ from eager ones (tokens or logprobs, compared exactly)"


def test_first_forward_of_a_shape_is_a_warm_up_not_a_recording(tiny_model_dir, replays):
    """One-token prompts make the very first forward decode-shaped; what layers build on
    their first call (cached norm weights) must not make that shape unreplayable."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [7]}], params, use_tqdm=False)
    graphs = llm.engine.worker.graph_runner.graphs
    assert any(g is not None for g in graphs.values()), "the 1-row shape was never recorded"
    assert replays["n"] == 4, f"{replays['n']} replays of 6 steps (expected: a warm-up, a recording, 4 replays)"


def test_a_new_shape_after_the_warm_up_is_recorded_at_once(tiny_model_dir, replays):
    """Only the replayer's first forward is a warm-up: a batch size met later is recorded
    the first time it is met and replayed from its next step on."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [7]}], params, use_tqdm=False)  # warm-up, recording, 2 replays
    assert replays["n"] == 2
    llm.generate([{"prompt_token_ids": [7, 8]}, {"prompt_token_ids": [9, 10]}], params, use_tqdm=False)
    # 3 decode steps of 2 rows: the first recorded, the other two replayed
    assert replays["n"] == 4, f"{replays['n'] - 2} replays of a new shape's 3 decode steps (expected 2)"


def test_conversions_that_return_their_input_are_not_replayed(tiny_model_dir, tmp_path, replays):
    """A GGUF layer hands its kernels `x.float()` and returns `out.to(x.dtype)`: on float32
    activations both return their input, compute nothing, and must not be recorded as torch
    ops (they made SmolLM2's decode graphs replay 300 no-op calls per step)."""
    from tests.plugins.quant.test_gguf_model import TINY_PROMPTS, T, _greedy, _tiny_llm, write_gguf

    hf_dir = tiny_model_dir("llama")
    llm = _tiny_llm(write_gguf(hf_dir, tmp_path / "tiny-q8.gguf", "llama", linear_type=T.Q8_0), hf_dir)
    _greedy(llm, TINY_PROMPTS)
    graphs = [g for g in llm.engine.worker.graph_runner.graphs.values() if g is not None]
    assert graphs and all(g.verified for g in graphs), "the GGUF model's decode steps were not recorded"
    assert all(not g.ops for g in graphs), \
        f"no-op conversions were recorded as torch ops: {sorted({f.__name__ for g in graphs for _, f, *_ in g.ops})}"
    assert replays["n"] > 0


def test_forward_with_torch_ops_is_replayed_too(tiny_model_dir, replays):
    """Qwen3 normalises q and k per head with torch ops between kernels: those calls are
    recorded in order with the kernels and run again on replay, with the same result."""
    model_dir = tiny_model_dir("qwen3")
    llm, got = generate(model_dir)
    graphs = [g for g in llm.engine.worker.graph_runner.graphs.values() if g is not None]
    assert graphs and all(g.ops for g in graphs), "Qwen3's decode steps were not recorded with their torch ops"
    assert all(g.verified for g in graphs)
    assert replays["n"] >= 7
    _, eager = generate(model_dir, enforce_eager=True)
    assert got == eager, "replayed torch ops gave other tokens or logprobs than eager steps"


def test_moe_steps_are_replayed(tmp_path, replays):
    """Qwen3-MoE's routed experts run in one native call (csrc/moe.c) with no host sync,
    so its decode steps are recorded (routing's torch ops included) and replay exactly."""
    from tests.plugins.models.test_qwen_moe import build

    model_dir = build(tmp_path / "qwen3moe", "qwen3moe")
    llm, got = generate(model_dir)
    graphs = [g for g in llm.engine.worker.graph_runner.graphs.values() if g is not None]
    assert graphs and all(g.verified for g in graphs), "Qwen3-MoE's decode steps were not recorded"
    # routing's torch ops split the kernel calls into segments, each run as part of one C program
    assert all(g.ops and g.program is not None for g in graphs), "MoE graphs did not run their kernels from C"
    assert replays["n"] >= 7, f"only {replays['n']} MoE steps were replayed"
    _, eager = generate(model_dir, enforce_eager=True)
    assert got == eager, "replayed MoE steps gave other tokens or logprobs than eager steps"


@pytest.mark.parametrize("kernel", ["onednn", "native"])
def test_bf16_products_are_replayed(tiny_model_dir, replays, monkeypatch, kernel):
    """Under "medium" precision the GEMMs are oneDNN calls (torch ops between the kernels)
    or, on a CPU with AMX or AVX512-BF16, native pd_amx_linear / pd_bf16dot_linear calls;
    either way their replays equal eager steps of the same precision exactly."""
    from pagedllm.ops.cpu import native
    from pagedllm.plugins.cpu_native import ops as cpu_ops

    if kernel == "native" and not (native.available() and native.bf16_tiles_kernel()):
        pytest.skip("neither AMX nor AVX512-BF16 on this CPU")
    if kernel == "onednn":
        if not cpu_ops.dense._onednn_available():
            pytest.skip("oneDNN's packed linear is unavailable")
        monkeypatch.setattr(cpu_ops.dense, "_native_bf16_kernel", lambda: None)
    monkeypatch.setenv("PAGEDLLM_FLOAT32_MATMUL_PRECISION", "medium")
    monkeypatch.setattr(cpu_ops, "bf16_products_pay", lambda: True)  # bf16 even where it is emulated
    monkeypatch.setattr(cpu_ops.crossover, "rows_from", lambda what, small, large, k: 1)
    model_dir = tiny_model_dir("llama")
    llm, got = generate(model_dir)
    assert llm.engine.worker.matmul_precision == "medium"
    graphs = [g for g in llm.engine.worker.graph_runner.graphs.values() if g is not None]
    assert graphs and all(g.verified for g in graphs)
    if kernel == "onednn":
        assert any("linear_pointwise" in getattr(func, "__name__", repr(func)) for g in graphs for _, func, *_ in g.ops)
    else:
        names = {"pd_amx_linear", "pd_bf16dot_linear"}
        assert any(name in names for g in graphs for name, *_ in g.calls), \
            "no native bf16 GEMM was recorded"
    assert replays["n"] >= 7
    _, eager = generate(model_dir, enforce_eager=True)
    assert got == eager


def test_forward_reading_tensor_values_stays_eager(tiny_model_dir, replays, monkeypatch):
    """A forward whose Python reads a tensor's value (`.item()`) could take another path
    on another step: such shapes are never recorded."""
    from pagedllm.plugins.models import layers

    original = layers.RMSNorm.forward

    def reads_a_value(self, x, *args, **kwargs):
        x.sum().item()
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(layers.RMSNorm, "forward", reads_a_value)
    model_dir = tiny_model_dir("llama")
    llm, got = generate(model_dir)
    graphs = llm.engine.worker.graph_runner.graphs
    assert graphs and all(g is None for g in graphs.values()), "a forward that reads tensor values was recorded"
    assert replays["n"] == 0
    _, eager = generate(model_dir, enforce_eager=True)
    assert got == eager


def test_a_replay_that_differs_turns_replay_off(tiny_model_dir, monkeypatch):
    original = replay.StepGraph.replay

    def corrupted(self, inputs):
        out = original(self, inputs)
        out.add_(1.0)
        return out

    monkeypatch.setattr(replay.StepGraph, "replay", corrupted)
    model_dir = tiny_model_dir("llama")
    llm, got = generate(model_dir)
    assert llm.engine.worker.graph_runner.off, "a replay that differs from its eager run left replay on"
    _, eager = generate(model_dir, enforce_eager=True)
    assert got == eager, "the eager result should have been used when the replay differed"


def test_graph_patches_the_step_inputs_only(tiny_model_dir):
    """Every argument pointing into a step input is patched; weights, caches and the
    recorded intermediates stay as recorded."""
    llm, _ = generate(tiny_model_dir("llama"))
    graph = next(g for g in llm.engine.worker.graph_runner.graphs.values() if g is not None)
    patched = {graph.input_names[source] for *_, patches, _ in graph.calls for _, source, _ in patches}
    assert {"input_ids", "positions", "metadata.slot_mapping", "metadata.block_tables", "metadata.seq_lens",
            "metadata.query_start", "metadata.row_start"} <= patched, patched
    assert graph.nbytes > 0 and graph.nbytes < 1 << 20, f"{graph.nbytes} bytes kept for a tiny model's step"


def test_a_graph_over_the_memory_budget_stays_eager(tiny_model_dir, replays):
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", kv_cache_memory=1 << 22)
    llm.engine.worker.graph_runner.max_bytes = 1024  # below any step's intermediates
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    graphs = llm.engine.worker.graph_runner.graphs
    assert graphs and all(g is None for g in graphs.values()), "a graph over the byte budget was kept"
    assert replays["n"] == 0


def test_a_slower_replay_with_torch_ops_stays_eager(tiny_model_dir, monkeypatch):
    """A graph with torch ops whose first replay took longer than the eager run is dropped."""
    import time

    monkeypatch.setattr(replay, "DROP_SLOWER", True)
    original = replay.StepGraph.replay

    def slow(self, inputs):
        time.sleep(0.05)
        return original(self, inputs)

    monkeypatch.setattr(replay.StepGraph, "replay", slow)
    model_dir = tiny_model_dir("qwen3")
    llm, got = generate(model_dir)
    replayer = llm.engine.worker.graph_runner
    assert replayer.graphs and all(g is None for g in replayer.graphs.values()), "a slower graph was kept"
    assert not replayer.off
    _, eager = generate(model_dir, enforce_eager=True)
    assert got == eager


def test_every_kernel_replayed_in_c_takes_the_arguments_ctypes_passes():
    """csrc/replay.c's table and native.py's ctypes signatures agree (`_replay_id` raises
    where they do not), and every kernel a forward calls is in it."""
    replayed = {name for name in native._SIGNATURES if native._replay_id(name) is not None}
    forward = {"pd_rms_norm", "pd_silu_mul", "pd_rope_neox", "pd_gather_rows", "pd_gather_rows_bf16", "pd_argmax_rows",
               "pd_write_kv", "pd_write_kv_bf16", "pd_paged_attention", "pd_paged_attention_bf16", "pd_linear_packed",
               "pd_linear_packed_gemm", "pd_linear_lut4", "pd_sgemm", "pd_moe_f32", "pd_amx_linear",
               "pd_amx_linear_silu", "pd_amx_qt_linear", "pd_amx_qt_linear_silu", "pd_bf16dot_linear",
               "pd_bf16dot_linear_silu", "pd_vnni_linear", "pd_dequantize"}
    assert replayed == forward, replayed ^ forward


def test_a_c_program_patches_inputs_and_stops_at_a_changed_return():
    """A program's patched pointer argument follows the step input's new address; a kernel
    returning other than its recording stops the program there and names its index."""
    import ctypes

    import torch

    table = torch.arange(12, dtype=torch.float32).view(4, 3)
    ids, out = torch.tensor([2, 0], dtype=torch.int64), torch.zeros(2, 3)
    args = (table.data_ptr(), 4, 3, 0, 2, out.data_ptr())  # ids: patched, offset 0 into input 0
    program = native.ReplayProgram.build([("pd_gather_rows", args, [(3, 0, 0)], 0)] * 2)
    bases = (ctypes.c_int64 * 1)(ids.data_ptr())
    assert program.run(bases) == -1
    assert torch.equal(out, table[[2, 0]])
    other = torch.tensor([3, 1], dtype=torch.int64)
    bases[0] = other.data_ptr()
    assert program.run(bases) == -1
    assert torch.equal(out, table[[3, 1]]), "the patched argument did not follow the new input"
    bad = torch.tensor([1, 9], dtype=torch.int64)  # 9 is outside the table: PD_EINVAL, recorded PD_OK
    bases[0] = bad.data_ptr()
    assert program.run(bases, start=1) == 1
    assert program.run(bases, start=0, end=0) == -1


def test_recorded_steps_run_as_one_c_program(tiny_model_dir):
    llm, _ = generate(tiny_model_dir("llama"))
    graphs = [g for g in llm.engine.worker.graph_runner.graphs.values() if g is not None]
    assert graphs and all(g.program is not None for g in graphs), "a graph fell back to call-by-call replay"


def test_call_by_call_replay_equals_eager_too(tiny_model_dir, replays, monkeypatch):
    """Graphs with a kernel outside csrc/replay.c's table replay from Python, call by call."""
    monkeypatch.setattr(native.ReplayProgram, "build", classmethod(lambda cls, calls: None))
    model_dir = tiny_model_dir("llama")
    llm, got = generate(model_dir)
    graphs = [g for g in llm.engine.worker.graph_runner.graphs.values() if g is not None]
    assert graphs and all(g.program is None and g.verified for g in graphs)
    assert replays["n"] >= 7
    _, eager = generate(model_dir, enforce_eager=True)
    assert got == eager
