#!/usr/bin/env bash
# Engine throughput on one CUDA GPU, bfloat16, on random-weight models of real shapes
# (scripts/random_model.py: speed does not depend on the weights' values; EOS is ignored):
# SmolLM2-135M's shape and a Llama-1B's (hidden 2048, 16 layers, 32 heads / 8 KV heads),
# `pagedllm bench throughput` with the TRITON and TORCH attention backends, then
# `pagedllm bench compare` beside transformers generate() on the same GPU (vLLM and the
# peers' venvs are not on a GPU machine without a registry).
#   bash scripts/gpu_engine_bench.sh LIKE_DIR [OUT_DIR]
# LIKE_DIR: config.json and tokenizer files of SmolLM2-135M (weights not needed).
# Env: BENCH_MODELS ("m135 m1b"), BENCH_BACKENDS ("TRITON TORCH"), COMPARE_MODELS ("m135").
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LIKE=$1
OUT_DIR=${2:-/tmp/gpu-bench}
MODELS=${MODELS_DIR:-/tmp/gpu-models}
mkdir -p "$OUT_DIR" "$MODELS"
m135=$MODELS/m135 m1b=$MODELS/m1b
BENCH_MODELS=${BENCH_MODELS-m135 m1b}
BENCH_BACKENDS=${BENCH_BACKENDS-TRITON TORCH}
COMPARE_MODELS=${COMPARE_MODELS-m135}
wanted="$BENCH_MODELS $COMPARE_MODELS"
if [[ " $wanted " == *" m135 "* ]]; then "$PYTHON" scripts/random_model.py "$m135" --like "$LIKE" || exit 1; fi
if [[ " $wanted " == *" m1b "* ]]; then
  "$PYTHON" scripts/random_model.py "$m1b" --like "$LIKE" --set hidden_size=2048 --set intermediate_size=8192 \
    --set num_hidden_layers=16 --set num_attention_heads=32 --set num_key_value_heads=8 || exit 1
fi

status=0
for name in $BENCH_MODELS; do
  model=$MODELS/$name
  for backend in $BENCH_BACKENDS; do
    echo "--- $(basename "$model") $backend: 256 prompts x 128 in / 128 out"
    "$PYTHON" -m pagedllm.cli bench throughput "$model" --dtype bfloat16 --attention-backend "$backend" \
      --num-prompts 256 --input-len 128 --output-len 128 --disable-tqdm 2>&1 \
      | grep -v -E "^(INFO|DEBUG) .*: op " || status=1
  done
done
for name in $COMPARE_MODELS; do
  echo "--- $name side by side with transformers generate() on this GPU (64 prompts; serve at 64 concurrent)"
  "$PYTHON" -m pagedllm.cli bench compare "$MODELS/$name" --hf-model "$MODELS/$name" \
    --engines pagedllm,transformers-bf16 --dtype bfloat16 --num-prompts 64 --input-len 128 --output-len 128 \
    --single-stream-prompts 2 --output-json "$OUT_DIR/compare-$name.json" || status=1
done
exit $status
