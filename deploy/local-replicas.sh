#!/usr/bin/env bash
# Two replicas and a router on this machine, over loopback tcp with CURVE keys: the
# multi-machine recipe (deploy/multi-host.md) in miniature. Runs until Ctrl-C or SIGTERM,
# then stops everything; a replica that exits is started again, as launchd's KeepAlive
# or systemd's Restart= would.
#
#   deploy/local-replicas.sh MODEL_DIR [HTTP_PORT] [FIRST_REPLICA_PORT]
#
# Environment: KEYS (a `radix-mlx keys` directory, made when missing; default: a temporary
# one), REPLICA_ARGS and ROUTER_ARGS (more flags), RADIX_MLX (the command).
set -euo pipefail
MODEL=${1:?usage: local-replicas.sh MODEL_DIR [HTTP_PORT] [FIRST_REPLICA_PORT]}
PORT=${2:-30000}
RPORT=${3:-31000}
RADIX_MLX=${RADIX_MLX:-radix-mlx}
TMP=$(mktemp -d)
KEYS=${KEYS:-$TMP/keys}
trap 'exit 0' TERM INT
trap 'kill $(jobs -p) 2>/dev/null || true; wait || true; rm -rf "$TMP"' EXIT

keep_running() {
  trap 'kill "$pid" 2>/dev/null; wait "$pid"; exit 0' TERM
  while true; do
    "$@" &
    pid=$!
    wait "$pid" || true
    sleep 1
  done
}

[ -e "$KEYS/replica.key_secret" ] || "$RADIX_MLX" keys --out "$KEYS" >/dev/null
for port in "$RPORT" "$((RPORT + 1))"; do
  # shellcheck disable=SC2086  # REPLICA_ARGS is a list of flags
  keep_running "$RADIX_MLX" replica --model-path "$MODEL" --listen "tcp://127.0.0.1:$port" \
    --curve-secret-key "$KEYS/replica.key_secret" --curve-authorized-keys "$KEYS/authorized" \
    ${REPLICA_ARGS:-} &
done
# shellcheck disable=SC2086
"$RADIX_MLX" serve --model-path "$MODEL" --port "$PORT" --dp-size 0 \
  --replica "tcp://127.0.0.1:$RPORT" --replica "tcp://127.0.0.1:$((RPORT + 1))" \
  --curve-secret-key "$KEYS/router.key_secret" --curve-server-key "$KEYS/replica.key" \
  ${ROUTER_ARGS:-} &
router=$!
echo "router on http://127.0.0.1:$PORT, replicas on tcp://127.0.0.1:$RPORT and :$((RPORT + 1))"
wait "$router"
