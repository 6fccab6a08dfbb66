#!/usr/bin/env bash
# Every GPU check in one run, for a CUDA machine, most valuable first, inside one deadline:
#   1. environment: GPU, python, torch, triton, which optional libraries exist;
#   2. attention kernels: `pytest -m cuda tests/plugins/attention` (every runnable backend vs
#      the TORCH reference in fp16/bf16 (+ FP8 cache), then through the engine);
#   3. the engine on the GPU against transformers: tests/test_cuda_engine.py (bf16 vs
#      transformers' bf16, the GPU memory plan) and the CPU suite's transformers-parity
#      modules with PAGEDLLM_TEST_DEVICE=cuda (plain, chunked prefill, prefix caching,
#      preemption, every speculative method, AWQ/GPTQ/FP8, MoE, Gemma 3, DeepSeek MLA);
#   4. quantization and MoE kernels: the Triton dequant-GEMM (AWQ/GPTQ/NF4), the block-FP8
#      GEMM, FP8 W8A8 through torch._scaled_mm, the MoE grouped GEMM;
#   5. engine throughput (`pagedllm bench`) on random-weight models of SmolLM2-135M's and a
#      Llama-1B's shape in bfloat16, TRITON and TORCH, beside transformers generate() on the
#      same GPU (the peers' venvs and vLLM do not exist there);
#   6. scripts/gpu_attention_bench.py: decode and prefill time per backend with bandwidth.
# Works offline. A GPU machine without a registry lacks some of pagedllm's dependencies:
# carry them as wheels for its Python (3.12 on the H200 machines), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     gguf starlette uvicorn llguidance
# and install them there first: pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# with PYTHONPATH=/tmp/site. MODEL_LIKE (default .gpu/smollm2-config: copy config.json and the
# tokenizer files, not the weights, from .peers/smollm2-hf, which scripts/setup_peers.sh makes)
# holds the model shape for stage 5 (skipped without it). Logs go to $OUT when set.
# Env: PYTHON (python3), DEADLINE (seconds for the whole run, default 520), STAGES (default
# "attention engine quant bench attention_bench": the stages to run), BENCH_BUDGET (120 s), and
# gpu_engine_bench.sh's.
# Exit status: 0 when every stage that ran passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DEADLINE=${DEADLINE:-520}
MODEL_LIKE=${MODEL_LIKE:-.gpu/smollm2-config}
LOGS=${OUT:-/tmp/gpu-check}
mkdir -p "$LOGS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels on the GPU, never the CPU interpreter
START=$SECONDS
FAILED=()

STAGES=" ${STAGES:-attention engine quant bench attention_bench} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
stage() { printf '\n===== %s (t=%ds) =====\n' "$*" "$((SECONDS - START))"; }
left() { echo $((DEADLINE - (SECONDS - START))); }
# run NAME BUDGET CMD...: CMD under `timeout min(BUDGET, time left - 10)`, its output also in $LOGS/NAME.log
run() {
  local name=$1 budget=$2; shift 2
  local limit; limit=$(left); limit=$((limit - 10))
  if [ "$budget" -lt "$limit" ]; then limit=$budget; fi
  if [ "$limit" -lt 20 ]; then echo "[$name] skipped: the deadline is near"; FAILED+=("$name(no time)"); return; fi
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  local status=${PIPESTATUS[0]}
  if [ "$status" -eq 124 ]; then echo "[$name] timed out after ${limit}s"; fi
  if [ "$status" -ne 0 ]; then FAILED+=("$name($status)"); fi
}
PYTEST=("$PYTHON" -m pytest -q -rs -p no:cacheprovider --timeout 120 --durations 8)

stage "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || echo "nvidia-smi failed"
nproc; "$PYTHON" - <<'EOF' || exit 1
import importlib.util, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"GPU available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU visible to torch: this script is for a CUDA machine")
print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("triton", "flash_attn", "flashinfer", "pluggy", "transformers", "pytest", "pytest_timeout",
             "gguf", "starlette", "uvicorn", "llguidance"):
    spec = importlib.util.find_spec(name)
    version = ""
    if spec is not None:
        try:
            version = getattr(__import__(name), "__version__", "")
        except Exception as exc:  # a library that fails to import is worth seeing here
            version = f"(import fails: {exc})"
    print(f"  {name:15s} {'missing' if spec is None else 'present ' + str(version)}")
missing = [n for n in ("pluggy", "pytest", "pytest_timeout") if importlib.util.find_spec(n) is None]
if missing:
    sys.exit(f"required for the checks but missing: {', '.join(missing)}")
EOF

if ! "$PYTHON" -c "import importlib.metadata as m; m.distribution('pagedllm')" 2>/dev/null; then
  stage "installing pagedllm (editable, no deps, offline) for its plugin entry points"
  "$PYTHON" -m pip install -q --no-deps --no-index --no-build-isolation -e . \
    || echo "editable install failed: engine-level tests will fail to find the built-in plugins"
fi

want attention && stage "attention kernels: pytest -m cuda tests/plugins/attention" && \
run attention 90 "${PYTEST[@]}" -m cuda tests/plugins/attention

# deselected, not failed: the bundled SmolLM2 GGUF (a pip package) and suffix decoding (arctic-inference,
# built against the installed torch) are not on a GPU machine without a registry
want engine && stage "the engine on the GPU vs transformers (PAGEDLLM_TEST_DEVICE=cuda)" && \
run engine 170 env PAGEDLLM_TEST_DEVICE=cuda PAGEDLLM_TEST_REPORT="$LOGS/figures.log" "${PYTEST[@]}" -k "not smollm2 and not suffix" \
  tests/test_cuda_engine.py tests/test_llm.py tests/plugins/attention/test_backends_e2e.py \
  tests/core/test_prompt_logprobs.py tests/plugins/spec_decode/test_parity.py \
  tests/plugins/spec_decode/test_eagle3.py tests/plugins/spec_decode/test_eagle.py \
  tests/plugins/quant/test_int_formats.py tests/plugins/quant/test_fp8.py \
  tests/plugins/models/test_qwen_moe.py tests/plugins/models/test_gemma3.py tests/plugins/models/test_deepseek.py

want quant && stage "quantization and MoE kernels (Triton int4/int8/NF4 dequant-GEMM, block-FP8 GEMM, FP8 _scaled_mm, MoE grouped GEMM)" && \
run quant 60 "${PYTEST[@]}" tests/plugins/quant/test_triton_int.py \
  tests/plugins/quant/test_triton_fp8.py "tests/plugins/quant/test_fp8.py::test_fp8_on_cuda_uses_scaled_mm" \
  tests/plugins/moe_triton

if want bench; then
  stage "engine throughput on random-weight models (bfloat16)"
  if [ -f "$MODEL_LIKE/config.json" ]; then
    run bench "${BENCH_BUDGET:-120}" bash scripts/gpu_engine_bench.sh "$MODEL_LIKE" "$LOGS"
  else
    echo "no $MODEL_LIKE/config.json: throughput stage skipped"
  fi
fi

want attention_bench && stage "attention micro-benchmark" && \
run attention_bench 60 "$PYTHON" scripts/gpu_attention_bench.py

stage "summary (t=$((SECONDS - START))s)"
if [ "${#FAILED[@]}" -eq 0 ]; then echo "every stage passed"; exit 0; fi
echo "failed stages: ${FAILED[*]}"
exit 1
