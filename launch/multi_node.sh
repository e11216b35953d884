#!/usr/bin/env bash
# Multi-node rollout recipe: one vLLM engine spanning NNODES nodes, kept on the newest version of a stream.
# Run it on every node with the same STREAM, MASTER_ADDR and VLLM_ARGS, and that node's NODE_RANK:
#
#   STREAM=s3://bucket/run1 NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch/multi_node.sh   # head
#   STREAM=s3://bucket/run1 NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./launch/multi_node.sh   # worker node
#
# Node 0 runs vLLM's API server (PORT) and the follower; every other node vLLM --headless and a node agent
# that prepares each new version into that node's cache (CACHE, the same path on every node: vLLM's
# workers read the weights from their own node's disk). The head reloads a version only once every rank
# holds it, and names the lagging nodes in its replica record meanwhile (`ckptstream replicas STREAM`).
set -euo pipefail

STREAM=${STREAM:?set STREAM to the stream URL}
NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:?set NODE_RANK (0 on the head node)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the address of the head node}
MASTER_PORT=${MASTER_PORT:-29501}
PORT=${PORT:-8000}
CACHE=${CACHE:-/dev/shm/ckptstream}
VLLM_ARGS=${VLLM_ARGS:-"--tensor-parallel-size 16 --dtype bfloat16"}

exec ckptstream serve "$STREAM" --nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" \
  --master-port "$MASTER_PORT" --port "$PORT" --cache-dir "$CACHE" ${VLLM_API_KEY:+--api-key "$VLLM_API_KEY"} \
  -- $VLLM_ARGS
