# Shared by the launch scripts (sourced after PY, READY_TIMEOUT and TAG are set): a private work
# directory ($WORK), the processes to stop ($PIDS: each started with setsid, so it leads its own
# session and is stopped with its children by its PID, TERM then KILL), a free loopback port, and
# a wait for an HTTP endpoint that fails fast with the log of the process behind it.
WORK=$(mktemp -d -t "kvbm-$TAG-XXXXXX")
chmod 700 "$WORK"
PIDS=()
cleanup() {
  local rc=$? pid
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  if [ "${KEEP_WORKDIR:-0}" = 1 ]; then echo "[$TAG] logs kept in $WORK"; else rm -rf "$WORK"; fi
  exit $rc
}
trap cleanup EXIT INT TERM

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_http() {  # $1 = pid, $2 = url, $3 = log file
  local deadline=$((SECONDS + READY_TIMEOUT))
  until curl -sf "$2" > /dev/null; do
    if ! kill -0 "$1" 2>/dev/null || [ $SECONDS -ge "$deadline" ]; then
      echo "[$TAG] ERROR: $2 not ready (process exited or ${READY_TIMEOUT}s passed); last log lines of $3:" >&2
      tail -n 40 "$3" >&2; exit 1
    fi
    sleep 1
  done
}
