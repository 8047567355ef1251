#!/usr/bin/env bash
# Run dph-async on several machines through Ray.
#
#   scripts/cluster.sh keys                 once: CURVE keys (copy the directory to every node)
#   scripts/cluster.sh head                 on the head node (the learner and the replay run here)
#   scripts/cluster.sh worker HEAD_IP       on every other node (vLLM actors spread over them)
#   scripts/cluster.sh run [ARGS...]        on the head: dph-async run on the cluster
#   scripts/cluster.sh stop                 on every node
#
# Services listen beyond loopback only with CURVE keys: `run` passes net.host=0.0.0.0 and
# net.curve_keys=$KEYS, so actors on other nodes authenticate to the replay and weight server.
set -euo pipefail
cd "$(dirname "$0")/.."
KEYS="${DPH_KEYS:-keys}"
PORT="${RAY_PORT:-6379}"
bash scripts/setup.sh
case "${1:-}" in
  keys)   .venv/bin/dph-async keys "$KEYS" ;;
  head)   .venv/bin/ray start --head --port "$PORT" --include-dashboard=false ;;
  worker) .venv/bin/ray start --address "${2:?usage: cluster.sh worker HEAD_IP}:$PORT" ;;
  run)    shift; .venv/bin/dph-async run launcher.address=auto net.host=0.0.0.0 "net.curve_keys=$KEYS" "$@" ;;
  stop)   .venv/bin/ray stop ;;
  *)      sed -n '2,12p' "$0"; exit 2 ;;
esac
