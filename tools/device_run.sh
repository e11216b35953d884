#!/usr/bin/env bash
# The device encoder's run on one GPU (issue 12, parts 1-3), in at most 9 minutes; logs and JSON under $OUT.
#
#   bash tools/device_run.sh            # on the device machine, from the repository root
#
# Wheels of missing packages (zstandard, xxhash, fsspec, megatron-core), if carried in .whl/, are installed
# into /tmp/site first. Steps, each under its own time limit (the run goes on if one fails):
#   1. tools/check_device_encode.py --size 256MB: the device encoder against the host encoder byte for byte,
#      bit-exact decodes, the host/device mix on one stream, device memory before/peak/after;
#   2. tools/bench_gpu_snapshot.py --size 15GB --steps 6: the targets beside the pinned D2H floor;
#   3. tools/bench_megatron_publish.py on 1 GPU (if megatron-core imports): blocking against a synchronous save;
#   4. time permitting, the host path of step 2 (--device-delta off) for comparison.
# SMOKE=1 runs the same steps on the CPU with small models (a check of this script without a GPU).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device-run}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "warning: installing .whl/*.whl failed"
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "${SMOKE:-0}" = 1 ]; then
    echo "CPU smoke run"; DEV="--device cpu"; BIG=64MB; SMALL=16MB; MEGATRON=64MB
else
    python3 -c "import torch; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__)" || exit 1
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader || true
    DEV=""; BIG=15GB; SMALL=256MB; MEGATRON=4GB
fi
python3 -c "import zstandard, xxhash, fsspec, safetensors" || { echo "missing zstandard/xxhash/fsspec/safetensors"; exit 1; }
SCRATCH=$(mktemp -d /tmp/ckptstream-run.XXXXXX)
BUDGET=530  # seconds for the steps (9 minutes less what the start took)
step() {  # step NAME LIMIT_S COMMAND...: run under min(LIMIT_S, time left), output to $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 30 ]; then echo "== $name: skipped (${left}s left)"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s): $*"
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} after ${SECONDS}s in all"
    df -h /tmp | tail -1
}
# shellcheck disable=SC2086  # $DEV is empty or two words
step check 100 python3 tools/check_device_encode.py $DEV --size $SMALL --json "$OUT/check.json"
step bench 270 python3 tools/bench_gpu_snapshot.py $DEV --size $BIG --steps 6 --keyframe-every 4 --workers 16 \
    --dir "$SCRATCH/bench" --json "$OUT/bench.json"
rm -rf "$SCRATCH/bench"
if python3 -c "import megatron.core" 2>/dev/null; then
    step megatron 130 torchrun --standalone --nproc-per-node 1 tools/bench_megatron_publish.py --size $MEGATRON --steps 4 \
        --dir "$SCRATCH/megatron" --json "$OUT/megatron.json"
    rm -rf "$SCRATCH/megatron"
else
    echo "== megatron: skipped (megatron-core does not import)"
fi
step bench_host 150 python3 tools/bench_gpu_snapshot.py $DEV --size $BIG --steps 3 --keyframe-every 10 --workers 16 \
    --device-delta off --dir "$SCRATCH/host" --json "$OUT/bench_host.json"
rm -rf "$SCRATCH"
echo "== done after ${SECONDS}s"
