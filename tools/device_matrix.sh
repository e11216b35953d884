#!/usr/bin/env bash
# In-place updates on GPU vLLM 0.24 (one H200): the applier's depth benchmark and the shape matrix (issue 36).
#
#   STEP=apply bash tools/device_matrix.sh                       # tools/bench_apply.py on the GPU (~2 min)
#   STEP=matrix SHAPES="moe mla" bash tools/device_matrix.sh     # tools/bench_matrix.py (~3-4 min a shape)
#
# GPU vLLM 0.24.0 is installed from /tmp/gpu-vllm (../shared/device/GPU-VLLM.md: carried in parts) and .whl/
# (zstandard) into /tmp/site, once per machine. The baseline applier for STEP=apply is .bench/apply_old.py
# (`git show 2643a1c:ckptstream/vllm_loader/apply.py`), carried. Logs and JSON under $OUT.
set -u
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/device-matrix}
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
case "${STEP:-matrix}" in
apply)
    timeout "${SECONDS_LIMIT:-300}" python3 tools/bench_apply.py --device cuda --layers ${LAYERS:-8 16} --experts 128 \
        --hidden 2048 --intermediate 768 --repeat 3 --check ${BASELINE:+--baseline $BASELINE} --json "$OUT/apply.json" \
        2>&1 | tee "$OUT/apply.log"
    ;;
matrix)
    timeout "${SECONDS_LIMIT:-560}" python3 tools/bench_matrix.py --shapes ${SHAPES:-moe} ${LAYERS:+--layers $LAYERS} \
        --size "${SIZE:-15GB}" --updates "${UPDATES:-3}" --workdir /dev/shm/matrix --json "$OUT/matrix.json" 2>&1 \
        | grep -v -E "^(INFO|DEBUG)|^\(EngineCore" | tee "$OUT/matrix.log"
    ;;
esac
