#!/usr/bin/env bash
# Serve a hybrid Mamba+attention model with `vllm serve`, KV events and this plugin; subscribe to the
# event stream, send a short and a long prompt (the long one twice), and print an event summary.
#   ./scripts/launch_hybrid.sh [MODEL_DIR]      (default: a tiny local Qwen3-Next)
# Env: BLOCK_SIZE (32), READY_TIMEOUT seconds (240), KEEP_WORKDIR=1 to keep logs.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
PY=$ROOT/.venv/bin/python
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
BLOCK_SIZE=${BLOCK_SIZE:-32}
READY_TIMEOUT=${READY_TIMEOUT:-240}
MODEL=${1:-$("$PY" -m vllm_kvbm_plugin.cli tiny-model qwen3next 2>/dev/null | tail -n 1)}

source "$ROOT/scripts/serve_common.sh"

echo "[launch] model $MODEL, block size $BLOCK_SIZE, http://127.0.0.1:$PORT, events $EVENTS"

setsid "$ROOT/.venv/bin/vllm" serve "$MODEL" "${SERVE_ARGS[@]}" > "$WORK/server.log" 2>&1 &
SERVER_PID=$!

wait_ready
grep -E "hash granularity preserved|KV events per|Setting attention block size" "$WORK/server.log" | sed 's/^/[server] /' || true

start_subscriber

complete() {  # $1 = label, $2 = prompt text
  local body
  body=$("$PY" -c 'import json,sys; print(json.dumps({"model":"model","prompt":sys.argv[1],"max_tokens":8,"temperature":0}))' "$2")
  curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' -d "$body" \
    | "$PY" -c 'import json,sys; u=json.load(sys.stdin)["usage"]; d=u.get("prompt_tokens_details") or {}; print("[request] %11s: prompt_tokens=%s cached_tokens=%s" % (sys.argv[1], u["prompt_tokens"], d.get("cached_tokens")))' "$1"
}
SHORT=$("$PY" -c 'print(" ".join(["kv cache block hash"] * 12))')
LONG=$("$PY" -c 'print(" ".join(["the router sends each request to the engine that holds its prefix"] * 30))')
complete short "$SHORT"
complete long "$LONG"
complete "long again" "$LONG"
sleep 2

stop_subscriber
echo "[launch] event summary (validated like a router would):"
"$PY" -m vllm_kvbm_plugin.cli validate "$WORK/events.jsonl" | tee "$WORK/summary.json"
"$PY" - "$WORK/subscriber.json" "$WORK/summary.json" <<'PY'
import json, sys
sub = json.load(open(sys.argv[1]))["subscriber"]
rep = json.load(open(sys.argv[2]))
print(f"[launch] batches received={sub['received']} recovered={sub['recovered']} lost={sub['lost']}; "
      f"validator errors={rep['errors']}")
sys.exit(1 if rep["errors"] or sub["lost"] else 0)
PY
