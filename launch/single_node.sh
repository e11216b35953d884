#!/usr/bin/env bash
# Single-node rollout recipe: one vLLM server per GPU group, one follower for all of them.
#
#   STREAM=s3://bucket/run1 ./launch/single_node.sh                 # 8 GPUs, eight TP=1 servers
#   STREAM=/mnt/nfs/run1 SERVERS=2 TP=4 ./launch/single_node.sh     # two TP=4 servers
#
# The follower fetches and decodes each new version once (into /dev/shm), then updates every server in
# turn; each server pauses only for its own update: a full reload, or, with ckptstream's worker extension and
# middleware (passed below), the change written in place in one call. The dev-mode control routes are unauthenticated:
# they bind to 127.0.0.1 here; set VLLM_API_KEY to require a key on every route.
set -euo pipefail

STREAM=${STREAM:?set STREAM to the stream URL}
SERVERS=${SERVERS:-8}
TP=${TP:-1}
BASE_PORT=${BASE_PORT:-8000}
CACHE=${CACHE:-/dev/shm/ckptstream}
VLLM_ARGS=${VLLM_ARGS:-"--dtype bfloat16"}

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait; }
trap cleanup EXIT INT TERM

# The servers start on the stream's latest version, materialized once.
MODEL_DIR=$(ckptstream materialize "$STREAM" latest "$CACHE/initial" --force --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["path"])')

urls=()
for ((i = 0; i < SERVERS; i++)); do
  port=$((BASE_PORT + i))
  first_gpu=$((i * TP))
  gpus=$(seq -s, "$first_gpu" $((first_gpu + TP - 1)))
  CUDA_VISIBLE_DEVICES=$gpus VLLM_SERVER_DEV_MODE=1 \
    python3 -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --host 127.0.0.1 --port "$port" \
      --tensor-parallel-size "$TP" ${VLLM_API_KEY:+--api-key "$VLLM_API_KEY"} \
      --worker-extension-cls ckptstream.vllm_loader.worker.WorkerExtension \
      --middleware ckptstream.vllm_loader.pause_route.PauseRoute $VLLM_ARGS &
  pids+=($!)
  urls+=(--vllm-url "http://127.0.0.1:$port")
done

# Waits for the servers itself (a restarted or late server is brought to the newest version).
ckptstream follow "$STREAM" "${urls[@]}" --cache-dir "$CACHE" &
pids+=($!)
wait -n
