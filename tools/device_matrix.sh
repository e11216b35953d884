#!/usr/bin/env bash
# In-place updates on GPU vLLM 0.24 (one H200): the applier's depth benchmark and the shape matrix (issue 36).
#
#   STEP=apply bash tools/device_matrix.sh                       # tools/bench_apply.py on the GPU (~2 min)
#   BASELINE_TREE=.baseline STEP=apply LAYERS=8 ENGINE=1 ...     # the same bench on an older tree's code first
#   STEP=matrix SHAPES="moe mla" bash tools/device_matrix.sh     # tools/bench_matrix.py (~3-4 min a shape)
#   PYSPY=1 PYSPY_AFTER=120 STEP=matrix ...                      # with py-spy's samples of every process: $OUT/spy.raw
#   KEEP=/dev/shm/keep UPDATES=0 STEP=matrix SHAPES=moe LAYERS=16 ...   # write and publish only; then, with UPDATES=2
#                                                                # in the next call, the run on what was kept
#
# GPU vLLM 0.24.0 is installed by tools/gpu_vllm_env.sh. STEP=apply's baseline is an older tree of the package, not
# ignored so that it travels (`mkdir .baseline && git archive OLD ckptstream tools | tar -x -C .baseline`): this
# tree's bench runs there on its code, then here. Logs and JSON under $OUT.
set -u
OUT=${OUT:-/tmp/device-matrix}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
. tools/gpu_vllm_env.sh || exit 1
case "${STEP:-matrix}" in
apply)
    for tree in ${BASELINE_TREE:-} .; do
        [ "$tree" = . ] || cp tools/bench_apply.py tools/baseline_module.py "$tree/tools/"
        ( cd "$tree" && echo "== $tree" && timeout "${SECONDS_LIMIT:-300}" python3 tools/bench_apply.py --device cuda \
            --layers ${LAYERS:-8 16} --experts 128 --hidden 2048 --intermediate 768 --repeat 3 --check \
            ${ENGINE:+--engine} --json "$OUT/apply-$(basename "$PWD").json" ) 2>&1 | tee -a "$OUT/apply.log"
    done
    ;;
matrix)
    if [ -n "${PYSPY:-}" ]; then  # py-spy (carried in .whl) samples the bench, the follower and vLLM's processes
        ( sleep "${PYSPY_AFTER:-0}"; pid=$(pgrep -f -o "^python3 tools/bench_matrix.py") &&
          /tmp/site/bin/py-spy record --pid "$pid" --subprocesses --threads --nonblocking --rate 100 --format raw \
              --output "$OUT/spy.raw" --duration "${PYSPY_SECONDS:-300}" >"$OUT/spy.log" 2>&1 ) &
    fi
    timeout "${SECONDS_LIMIT:-560}" python3 tools/bench_matrix.py --shapes ${SHAPES:-moe} ${LAYERS:+--layers $LAYERS} \
        --size "${SIZE:-15GB}" --updates "${UPDATES:-3}" ${HASHES:+--hashes} ${KEEP:+--keep $KEEP} --workdir /dev/shm/matrix \
        --json "$OUT/matrix.json" 2>&1 \
        | grep -v -E "^(INFO|DEBUG)|^\(EngineCore" | tee "$OUT/matrix.log"
    ;;
esac
