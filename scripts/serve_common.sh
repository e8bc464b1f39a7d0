# Sourced by the launch scripts (needs ROOT, PY, READY_TIMEOUT, BLOCK_SIZE): a private work directory, cleanup of
# every process they start, a free loopback port, local event sockets, and helpers to wait for
# `vllm serve` (failing loudly with the log tail) and to run the event subscriber.
WORK=$(mktemp -d -t kvbm-launch-XXXXXX)
chmod 700 "$WORK"
SERVER_PID="" SUB_PID=""
cleanup() {
  local rc=$?
  [ -n "$SUB_PID" ] && kill "$SUB_PID" 2>/dev/null || true
  if [ -n "$SERVER_PID" ]; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  if [ "${KEEP_WORKDIR:-0}" = 1 ]; then echo "[launch] logs kept in $WORK"; else rm -rf "$WORK"; fi
  exit $rc
}
trap cleanup EXIT INT TERM

PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
EVENTS="ipc://$WORK/kv-events"   # local sockets: nothing listens on the network
REPLAY="ipc://$WORK/kv-replay"
EVENTS_CONFIG="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"$EVENTS\",\"replay_endpoint\":\"$REPLAY\",\"topic\":\"kv\"}"
# the `vllm serve` flags every launch script uses (loopback only, KV events on the local sockets)
SERVE_ARGS=(--host 127.0.0.1 --port "$PORT" --dtype bfloat16 --max-model-len 2048 --enforce-eager
  --block-size "$BLOCK_SIZE" --enable-prefix-caching --enable-prompt-tokens-details
  --served-model-name model --kv-events-config "$EVENTS_CONFIG")

wait_ready() {  # until /v1/models answers; the server must have been started with setsid into SERVER_PID
  local deadline=$((SECONDS + READY_TIMEOUT))
  until curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "[launch] ERROR: vllm serve exited during startup; last log lines:" >&2
      tail -n 40 "$WORK/server.log" >&2; exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      echo "[launch] ERROR: vllm serve not ready after ${READY_TIMEOUT}s; last log lines:" >&2
      tail -n 40 "$WORK/server.log" >&2; exit 1
    fi
    sleep 1
  done
  echo "[launch] server ready after ${SECONDS}s"
}

start_subscriber() {  # records the stream to $WORK/events.jsonl, stats to $WORK/subscriber.json
  "$PY" -m vllm_kvbm_plugin.cli subscribe --endpoint "$EVENTS" --replay-endpoint "$REPLAY" --topic kv \
    --out "$WORK/events.jsonl" 2> "$WORK/subscriber.json" &
  SUB_PID=$!
  sleep 1
}

stop_subscriber() {
  kill -TERM "$SUB_PID"; wait "$SUB_PID" || true; SUB_PID=""
}
