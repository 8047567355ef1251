#!/usr/bin/env bash
# Run dph-async on several machines through Ray (README, "Run on a cluster").
#
#   scripts/cluster.sh keys                 once, on any node: CURVE keys and a Ray token in $DPH_KEYS;
#                                           copy that directory to the same path on every node
#   scripts/cluster.sh head                 on the head: the driver, the learner and the replay run here
#   scripts/cluster.sh worker HEAD_IP       on every other node: the vLLM actors run only on these
#   scripts/cluster.sh run [ARGS...]        on the head: `dph-async run ARGS` on this cluster (options
#                                           first, then KEY=VALUE overrides)
#   scripts/cluster.sh pool [--end]         on the head: the actor processes kept for later runs
#                                           (launcher.keep_actors_s), or end the idle ones
#   scripts/cluster.sh stop                 on every node: stop the Ray node this script started there
#
# Every node needs this checkout with its .venv (the same Python and packages everywhere), the key
# directory, and to reach the head over TCP (Ray's ports, and the replay and weight ports it opens).
# The model, the data and the run directory stay on the head: actors get the model's files, the
# prompts and the weights from it. Services listen beyond loopback only with CURVE keys: `run` passes
# net.host=0.0.0.0 and net.curve_keys=$DPH_KEYS. Ray itself runs with token authentication, the token
# being $DPH_KEYS/ray_token.
#
# Environment: DPH_KEYS (key directory, default keys), RAY_PORT (the head's port, 6379),
# DPH_NODE_IP (the address other nodes reach this one at; Ray guesses otherwise), DPH_CPUS (CPUs Ray
# may use on this node; all by default), DPH_STATE (this node's Ray pid, log and the head's address;
# .cluster). Extra arguments after `head` or `worker HEAD_IP` go to `ray start`.
set -euo pipefail
cd "$(dirname "$0")/.."
KEYS="${DPH_KEYS:-keys}"
PORT="${RAY_PORT:-6379}"
STATE="${DPH_STATE:-.cluster}"
usage() { sed -n '2,24p' "$0"; exit 2; }

ray_auth() {  # Ray's token authentication, with the token every node got with the keys
  [ -f "$KEYS/ray_token" ] || { echo "no $KEYS/ray_token: run '$0 keys' once and copy $KEYS to every node" >&2; exit 1; }
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH
  RAY_AUTH_TOKEN_PATH="$(cd "$KEYS" && pwd)/ray_token"
}

start_node() {  # ray start --block in the background; return once the node is up
  mkdir -p "$STATE"
  if [ -f "$STATE/ray.pid" ] && kill -0 "$(cat "$STATE/ray.pid")" 2>/dev/null; then
    echo "a Ray node started by this script is running here (pid $(cat "$STATE/ray.pid")); '$0 stop' first" >&2
    exit 1
  fi
  local args=(--block --disable-usage-stats)
  [ -n "${DPH_NODE_IP:-}" ] && args+=(--node-ip-address "$DPH_NODE_IP")
  [ -n "${DPH_CPUS:-}" ] && args+=(--num-cpus "$DPH_CPUS")
  # --block keeps `ray start` as the parent of this node's Ray processes: stopping it stops them all,
  # and nothing else on the machine (`ray stop` would stop every Ray process of the machine).
  # Workers at the node's own niceness, not Ray's 15: the actors and the learner are the job here.
  RAY_worker_niceness="${RAY_worker_niceness:-0}" \
    setsid .venv/bin/ray start "${args[@]}" "$@" </dev/null >"$STATE/ray.log" 2>&1 &
  echo $! >"$STATE/ray.pid"
  for _ in $(seq 240); do
    grep -q "will now block" "$STATE/ray.log" && { echo "Ray node up (log: $STATE/ray.log)"; return 0; }
    kill -0 "$(cat "$STATE/ray.pid")" 2>/dev/null || break
    sleep 0.5
  done
  tail -n 20 "$STATE/ray.log" >&2
  echo "the Ray node did not start (log: $STATE/ray.log)" >&2
  exit 1
}

case "${1:-}" in
  keys)
    bash scripts/setup.sh
    .venv/bin/dph-async keys "$KEYS"
    (umask 077 && .venv/bin/python -c "import secrets; print(secrets.token_hex(32))" >"$KEYS/ray_token")
    echo "Ray token written to $KEYS/ray_token" ;;
  head)
    shift
    bash scripts/setup.sh
    ray_auth
    start_node --head --port "$PORT" --include-dashboard=false "$@"
    # Ray's own record of the address it started at (what ray.init(address="auto") reads).
    cp "${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray/ray_current_cluster" "$STATE/head_address"
    echo "head at $(cat "$STATE/head_address"); on every other node: $0 worker ${DPH_NODE_IP:-HEAD_IP}" ;;
  worker)
    head="${2:?usage: cluster.sh worker HEAD_IP}"
    shift 2
    bash scripts/setup.sh
    ray_auth
    start_node --address "$head:$PORT" --labels dph-role=actor "$@" ;;
  run)
    shift
    [ -f "$STATE/head_address" ] || { echo "no head started here ($STATE/head_address): '$0 head' first" >&2; exit 1; }
    ray_auth
    # After the caller's arguments: options come before KEY=VALUE overrides in `dph-async run`.
    exec .venv/bin/dph-async run "$@" "launcher.address=$(cat "$STATE/head_address")" net.host=0.0.0.0 \
      "net.curve_keys=$(cd "$KEYS" && pwd)" ;;
  pool)
    shift
    [ -f "$STATE/head_address" ] || { echo "no head started here ($STATE/head_address): '$0 head' first" >&2; exit 1; }
    ray_auth
    exec .venv/bin/dph-async pool "$(cat "$STATE/head_address")" "$@" ;;
  stop)
    [ -f "$STATE/ray.pid" ] || { echo "no Ray node started by this script here"; exit 0; }
    pid="$(cat "$STATE/ray.pid")"
    if kill -TERM "$pid" 2>/dev/null; then
      for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    # Ray's record of the cluster started here (what ray.init and `ray status` read) outlives it
    # when `ray start` is stopped this way: remove it when it names the head stopped here.
    current="${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray/ray_current_cluster"
    if [ -f "$STATE/head_address" ] && [ -f "$current" ] && [ "$(cat "$current")" = "$(cat "$STATE/head_address")" ]; then
      rm -f "$current"
    fi
    rm -f "$STATE/ray.pid" "$STATE/head_address"
    echo "Ray node stopped" ;;
  *) usage ;;
esac
