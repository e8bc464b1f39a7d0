#!/usr/bin/env bash
# The Grafana dashboard's data without Grafana: `vllm serve` (a tiny Llama, KVBMConnector with CPU,
# disk and Redis tiers) scraped every second by Prometheus, a short load run ROUNDS times (hits from
# each tier, a corrupted disk block, a paused Redis server, a kvbm-pic: request: the scenario of
# tests/serve/test_dashboard.py), then a PNG of the dashboard's time-series panels
# (examples/grafana/vllm-kvbm.json) drawn from Prometheus' query API by examples/grafana/plot_panels.py.
#   ./scripts/launch_dashboard.sh [OUT.png]      (default: ./kvbm-dashboard.png)
# Env: ROUNDS (3), READY_TIMEOUT seconds (300), KEEP_WORKDIR=1 to keep logs and Prometheus' data.
# Needs prometheus and redis-server (scripts/setup.sh installs Debian's when run as root); matplotlib
# goes into a venv of its own, .cache/dashboard-venv (never .venv). Everything listens on 127.0.0.1.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
PY=$ROOT/.venv/bin/python
OUT=$(realpath -m "${1:-kvbm-dashboard.png}")
ROUNDS=${ROUNDS:-3}
READY_TIMEOUT=${READY_TIMEOUT:-300}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
for tool in prometheus redis-server; do
  command -v "$tool" > /dev/null || { echo "[dashboard] ERROR: no $tool (Debian: apt-get install $tool)" >&2; exit 1; }
done
PLOT=$ROOT/.cache/dashboard-venv
if ! "$PLOT/bin/python" -c "import matplotlib" 2> /dev/null; then
  echo "[dashboard] installing matplotlib into $PLOT"
  python3 -m venv "$PLOT" && "$PLOT/bin/pip" install -q matplotlib
fi
MODEL=$("$PY" -m vllm_kvbm_plugin.cli tiny-model llama 2> /dev/null | tail -n 1)

TAG=dashboard
source "$ROOT/scripts/launch_lib.sh"  # $WORK, $PIDS, cleanup on exit, free_port, wait_http

PORT=$(free_port) PROM_PORT=$(free_port) REDIS_PORT=$(free_port)
setsid redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --maxmemory 256mb \
  --maxmemory-policy allkeys-lru --daemonize no > "$WORK/redis.log" 2>&1 &
PIDS+=($!)
cat > "$WORK/prometheus.yml" <<YAML
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs: [{job_name: vllm, static_configs: [{targets: ['127.0.0.1:$PORT']}]}]
YAML
setsid prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" > "$WORK/prometheus.log" 2>&1 &
PIDS+=($!)
# the tier sizes the load is built for: 12 CPU slots and 30 disk slots of the tiny Llama's 16 KiB
KTC="{\"kv_connector\":\"KVBMConnector\",\"kv_connector_module_path\":\"vllm_kvbm_plugin.connector\",\"kv_role\":\"kv_both\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"cpu_bytes_to_use\":196608,\"disk_path\":\"$WORK/disk\",\"disk_bytes_to_use\":614400,\"remote_url\":\"redis://127.0.0.1:$REDIS_PORT/0\",\"measure_roofline\":true}}"
# dev mode for POST /reset_prefix_cache (vLLM's own cache only; the tiers keep their blocks)
VLLM_SERVER_DEV_MODE=1 setsid "$ROOT/.venv/bin/vllm" serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --dtype bfloat16 --max-model-len 1024 --enforce-eager --block-size 32 --enable-prefix-caching \
  --enable-prompt-tokens-details --served-model-name model --kv-transfer-config "$KTC" > "$WORK/server.log" 2>&1 &
PIDS+=($!)
wait_http "${PIDS[1]}" "http://127.0.0.1:$PROM_PORT/-/ready" "$WORK/prometheus.log"
wait_http "${PIDS[2]}" "http://127.0.0.1:$PORT/v1/models" "$WORK/server.log"
echo "[dashboard] vllm serve http://127.0.0.1:$PORT, Prometheus http://127.0.0.1:$PROM_PORT, ready after ${SECONDS}s"
START=$SECONDS

PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} "$PY" - "http://127.0.0.1:$PORT" "$REDIS_PORT" "$WORK/disk" "$ROUNDS" <<'PY'
import pathlib, sys, time

import redis

from tests.serve.test_dashboard import Load, run_load

url, redis_port, disk, rounds = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3]), int(sys.argv[4])
load = Load(url)
for n in range(rounds):
    t0 = time.monotonic()
    cached = run_load(load, redis.Redis(host="127.0.0.1", port=redis_port), disk)
    print(f"[load] round {n + 1}/{rounds}: {time.monotonic() - t0:.1f} s, cached tokens {cached}", flush=True)
    time.sleep(5)
PY
sleep 3  # the last counters scraped twice
grep -E "KV Transfer metrics" "$WORK/server.log" | tail -n 1 | sed 's/^/[server] /' || true
"$PLOT/bin/python" "$ROOT/examples/grafana/plot_panels.py" "http://127.0.0.1:$PROM_PORT" "$OUT" \
  --seconds $((SECONDS - START + 10)) --rate-interval 10s --var model_name=model --var engine=0
echo "[dashboard] open $OUT; for Grafana, import examples/grafana/vllm-kvbm.json (docs/dashboard.md)"
