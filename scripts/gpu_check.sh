#!/usr/bin/env bash
# GPU check of the attention backends, for a CUDA machine (one run, under 8 minutes):
#   1. the environment: GPU, python, torch, triton, and which optional libraries exist;
#   2. `pytest -m cuda tests/plugins/attention`: every runnable backend vs the TORCH
#      reference in fp16/bf16 (+ FP8 cache), then through the engine on a tiny model;
#   3. the quantization kernels: the Triton dequant-GEMM of AWQ/GPTQ/W4A16 against its
#      formula, FP8 W8A8 through torch._scaled_mm on a tiny model;
#   4. scripts/gpu_attention_bench.py: decode time at batch 1/32/128 x 2k context and
#      prefill time for 8k tokens per runnable backend, with achieved bandwidth.
# Works offline. Uses the working tree through PYTHONPATH; if `pagedllm` is not installed
# it installs it editable (--no-deps, --no-index) so the plugin entry points exist.
# Env: PYTHON (default python3), TEST_TIMEOUT (300 s), BENCH_TIMEOUT (240 s).
# Exit status: 0 all good; otherwise the first failing stage's status.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels on the GPU, never the CPU interpreter

stage() { printf '\n===== %s =====\n' "$*"; }

stage "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || echo "nvidia-smi failed (continuing; torch decides below)"
"$PYTHON" - <<'EOF'
import importlib.util, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"GPU available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU visible to torch: this script is for a CUDA machine")
print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("triton", "flash_attn", "flashinfer", "pluggy", "transformers", "pytest"):
    spec = importlib.util.find_spec(name)
    version = ""
    if spec is not None:
        try:
            version = getattr(__import__(name), "__version__", "")
        except Exception as exc:  # a library that fails to import is worth seeing here
            version = f"(import fails: {exc})"
    print(f"  {name:13s} {'missing' if spec is None else 'present ' + str(version)}")
missing = [n for n in ("pluggy", "pytest") if importlib.util.find_spec(n) is None]
if missing:
    sys.exit(f"required for the checks but missing: {', '.join(missing)}")
EOF

if ! "$PYTHON" -c "import importlib.metadata as m; m.distribution('pagedllm')" 2>/dev/null; then
  stage "installing pagedllm (editable, no deps, offline) for its plugin entry points"
  "$PYTHON" -m pip install -q --no-deps --no-index --no-build-isolation -e . \
    || echo "editable install failed: engine-level tests will fail to find the built-in plugins"
fi

stage "pytest -m cuda tests/plugins/attention"
status=0
timeout "$TEST_TIMEOUT" "$PYTHON" -m pytest -m cuda tests/plugins/attention -q -rs -p no:cacheprovider \
  || status=$?
if [ "$status" -eq 124 ]; then echo "pytest timed out after ${TEST_TIMEOUT}s"; fi

stage "pytest tests/plugins/quant + moe_triton (Triton int4/int8/NF4 dequant-GEMM, block-FP8 GEMM, FP8 _scaled_mm, MoE grouped GEMM)"
quant_status=0
timeout "$TEST_TIMEOUT" "$PYTHON" -m pytest tests/plugins/quant/test_triton_int.py tests/plugins/quant/test_triton_fp8.py \
  "tests/plugins/quant/test_fp8.py::test_fp8_on_cuda_uses_scaled_mm" tests/plugins/moe_triton \
  -q -rs -p no:cacheprovider || quant_status=$?
if [ "$status" -eq 0 ]; then status=$quant_status; fi

stage "attention micro-benchmark"
bench_status=0
timeout "$BENCH_TIMEOUT" "$PYTHON" scripts/gpu_attention_bench.py || bench_status=$?
if [ "$bench_status" -eq 124 ]; then echo "benchmark timed out after ${BENCH_TIMEOUT}s"; fi

stage "summary"
echo "pytest exit status: $status; benchmark exit status: $bench_status"
if [ "$status" -ne 0 ]; then exit "$status"; fi
exit "$bench_status"
