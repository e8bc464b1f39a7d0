#!/usr/bin/env bash
# Two `vllm serve` workers (a tiny hybrid model, this plugin, KV events) behind `vllm-kvbm route`.
# Sends a workload of shared prefixes through the router twice in one run, KV-aware and round-robin
# (fresh prefixes each time), and prints per request what the index predicted and what the worker
# served (cached_tokens), then the sums; then a text prompt twice (plain, streamed).
#   ./scripts/launch_router.sh [MODEL_DIR]      (default: a tiny local Qwen3-Next)
# Env: GROUPS_N (5 prefixes), ROUNDS (3 requests per prefix), PREFIX (640 tokens), SUFFIX (40),
# READY_TIMEOUT seconds (300), KEEP_WORKDIR=1 to keep logs. Everything listens on loopback only.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
PY=$ROOT/.venv/bin/python
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}  # GiB per worker
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}  # two engines on one NUMA node
READY_TIMEOUT=${READY_TIMEOUT:-300}
MODEL=${1:-$("$PY" -m vllm_kvbm_plugin.cli tiny-model qwen3next 2>/dev/null | tail -n 1)}
# The tiny model's SSM state in float32 (vLLM's CPU platform keeps it in bfloat16 on CPUs without
# AVX-512 BF16, and then vLLM 0.32 serves no prefix-cache hit at all for the hybrid model).
EXTRA=()
[ $# -ge 1 ] || EXTRA=(--mamba-ssm-cache-dtype float32)

TAG=router
source "$ROOT/scripts/launch_lib.sh"  # $WORK, $PIDS, cleanup on exit, free_port, wait_http

WORKER_ARGS=()
URLS=()
for i in 0 1; do
  port=$(free_port)
  events="ipc://$WORK/kv-events-$i" replay="ipc://$WORK/kv-replay-$i"
  config="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"$events\",\"replay_endpoint\":\"$replay\",\"topic\":\"kv\"}"
  setsid "$ROOT/.venv/bin/vllm" serve "$MODEL" --host 127.0.0.1 --port "$port" --dtype bfloat16 \
    --max-model-len 2048 --enforce-eager --block-size 32 --enable-prefix-caching \
    --enable-prompt-tokens-details --served-model-name model --kv-events-config "$config" "${EXTRA[@]}" \
    > "$WORK/worker-$i.log" 2>&1 &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:$port")
  WORKER_ARGS+=(--worker "http://127.0.0.1:$port,$events,$replay")
done
for i in 0 1; do wait_http "${PIDS[$i]}" "${URLS[$i]}/v1/models" "$WORK/worker-$i.log"; done
echo "[router] workers ready after ${SECONDS}s: ${URLS[*]} (model $MODEL)"

RPORT=$(free_port)
SEED_ARGS=()
[ -n "${PYTHONHASHSEED:-}" ] && SEED_ARGS=(--hash-seed "$PYTHONHASHSEED")
setsid "$PY" -m vllm_kvbm_plugin.cli route "${WORKER_ARGS[@]}" --topic kv --port "$RPORT" "${SEED_ARGS[@]}" \
  > "$WORK/router.log" 2>&1 &
PIDS+=($!)
wait_http "${PIDS[2]}" "http://127.0.0.1:$RPORT/health" "$WORK/router.log"
echo "[router] router on http://127.0.0.1:$RPORT"

"$PY" - "http://127.0.0.1:$RPORT" <<'PY'
"""The workload: GROUPS_N prefixes, ROUNDS requests each (prefix + a fresh suffix), interleaved by
round, so round-robin over two workers sends a prefix's requests to alternating workers."""
import json, os, random, sys, urllib.request

url = sys.argv[1]
groups, rounds = int(os.environ.get("GROUPS_N", 5)), int(os.environ.get("ROUNDS", 3))
prefix_len, suffix_len = int(os.environ.get("PREFIX", 640)), int(os.environ.get("SUFFIX", 40))


def complete(prompt, policy, stream=False):
    body = {"model": "model", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "X-KVBM-Policy": policy})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.read()


for seed, policy in ((1, "kv"), (2, "round-robin")):  # fresh prefixes per phase: both start cold
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 2000) for _ in range(prefix_len)] for _ in range(groups)]
    for r in range(rounds):
        for g in range(groups):
            complete(prefixes[g] + [rng.randrange(10, 2000) for _ in range(suffix_len)], policy)

stats = json.load(urllib.request.urlopen(url + "/router/stats", timeout=30))
for n, rec in enumerate(stats["requests"]):
    print(f"[request] #{n:2d} {rec['policy']:>11}: worker {rec['worker']} prompt_tokens={rec['prompt_tokens']} "
          f"predicted={rec['predicted']} served={rec['served']} scores={rec['scores']}")
kv, rr = stats["by_policy"]["kv"], stats["by_policy"]["round-robin"]
ratio = kv["served"] / rr["served"] if rr["served"] else float("inf")
print(f"[router] served cached tokens: kv={kv['served']} round-robin={rr['served']} ratio={ratio:.2f}")
print(f"[router] mispredicted: kv={kv['mispredicted']}/{kv['requests']} "
      f"round-robin={rr['mispredicted']}/{rr['requests']}")

# a text prompt (the router tokenizes it with a worker's /tokenize), then the same streamed
text = " ".join(["the router sends each request to the engine that holds its prefix"] * 30)
complete(text, "kv")
complete(text, "kv", stream=True)
for rec, how in zip(json.load(urllib.request.urlopen(url + "/router/stats", timeout=30))["requests"][-2:],
                    ("text", "text, streamed")):
    print(f"[{how}] worker {rec['worker']} prompt_tokens={rec['prompt_tokens']} "
          f"predicted={rec['predicted']} served={rec['served']}")
PY
