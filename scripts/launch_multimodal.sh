#!/usr/bin/env bash
# Serve a vision-language model with `vllm serve`, KVBMConnector's CPU tier and KV events; send text and
# image chat requests twice, resetting the engine's own prefix cache in between so the second pass is
# served from the CPU tier (image requests through a KV connector: the scenario that crashed Dynamo
# KVBM), then validate the event stream, including every prompt block's image extra_keys.
#   ./scripts/launch_multimodal.sh [MODEL_DIR]      (default: a tiny local Qwen2-VL)
# Env: BLOCK_SIZE (32), READY_TIMEOUT seconds (300), CPU_BYTES (64 MiB), KEEP_WORKDIR=1 to keep logs.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
PY=$ROOT/.venv/bin/python
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
BLOCK_SIZE=${BLOCK_SIZE:-32}
READY_TIMEOUT=${READY_TIMEOUT:-300}
CPU_BYTES=${CPU_BYTES:-67108864}
MODEL=${1:-$("$PY" -m vllm_kvbm_plugin.cli tiny-model qwen2vl 2>/dev/null | tail -n 1)}

source "$ROOT/scripts/serve_common.sh"

echo "[launch] model $MODEL, block size $BLOCK_SIZE, http://127.0.0.1:$PORT, events $EVENTS"
# The tiny model has no chat template; this one keeps vLLM's "string" content format, so vLLM puts
# each image's placeholder (<|vision_start|><|image_pad|><|vision_end|>) in front of the text.
cat > "$WORK/chat_template.jinja" <<'JINJA'
{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}
{% endfor %}assistant:
JINJA

# Dev mode only for POST /reset_prefix_cache (GPU prefix cache only; the CPU tier keeps its blocks).
# The server listens on 127.0.0.1 only.
VLLM_SERVER_DEV_MODE=1 setsid "$ROOT/.venv/bin/vllm" serve "$MODEL" "${SERVE_ARGS[@]}" \
  --chat-template "$WORK/chat_template.jinja" --limit-mm-per-prompt '{"image":2}' \
  --kv-transfer-config "{\"kv_connector\":\"KVBMConnector\",\"kv_connector_module_path\":\"vllm_kvbm_plugin.connector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"cpu_bytes_to_use\":$CPU_BYTES}}" \
  > "$WORK/server.log" 2>&1 &
SERVER_PID=$!

wait_ready
grep -E "KVBMConnector( worker)?: " "$WORK/server.log" | sed 's/^/[server] /' || true

start_subscriber

# Requests, and the prompts file for the validator: prompt token ids come from the server
# (return_token_ids); image placeholder ranges are the runs of the model's image token, checked
# against the server's usage (prompt_tokens, prompt_tokens_details.multimodal_tokens).
if ! "$PY" - "$PORT" "$MODEL" "$WORK/prompts.jsonl" <<'PY'
import base64, io, json, sys, time, urllib.request

from PIL import Image, ImageDraw

port, model_dir, prompts_path = sys.argv[1:4]
BASE = f"http://127.0.0.1:{port}"
cfg = json.load(open(f"{model_dir}/config.json"))
IMAGE_TOKEN = cfg.get("image_token_id", cfg.get("image_token_index"))


def post(path, body=None):
    req = urllib.request.Request(BASE + path, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def tier_loads():
    """CPU-tier blocks loaded so far (the connector's Prometheus counter)."""
    with urllib.request.urlopen(BASE + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines
               if l.startswith("vllm:kvbm_blocks_total{") and 'direction="load"' in l)


def png(size, fill, mark):
    img = Image.new("RGB", size, fill)
    ImageDraw.Draw(img).rectangle(mark, fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED = {"type": "image_url", "image_url": {"url": png((224, 224), (200, 30, 30), (20, 20, 90, 90))}}
# a client-given uuid becomes the image's identifier in vLLM's block hashes and events
BLUE = {"type": "image_url", "image_url": {"url": png((168, 112), (30, 30, 200), (100, 10, 150, 60))},
        "uuid": "kvbm-blue-1"}
SYSTEM = "you describe pictures for a kv cache test: " + "short answers about the image please " * 4
DESCRIBE = {"type": "text", "text": "describe the picture in a few words " * 6}
REQUESTS = [  # (name, user content parts); every request shares the system prefix
    ("text", [{"type": "text", "text": "what is a kv cache block and why hash it " * 8}]),
    ("red", [RED, DESCRIBE]),
    ("blue", [BLUE, DESCRIBE]),
    ("red+blue", [RED, BLUE, {"type": "text", "text": "compare the two pictures " * 6}]),
    ("text2", [{"type": "text", "text": "the router sends each request to the engine with its prefix " * 6}]),
]


def placeholders(ids, n_images):
    """Runs of the image token: one (offset, length) per image, as vLLM's placeholder ranges."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == IMAGE_TOKEN:
            j = i
            while j < len(ids) and ids[j] == IMAGE_TOKEN:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    assert len(runs) == n_images, f"{len(runs)} image token runs for {n_images} images"
    return runs


prompts, failed, image_tier_hits = {}, 0, 0
for pass_no in (1, 2):
    if pass_no == 2:  # drop the engine's own prefix cache: pass 2 can hit only the CPU tier
        for _ in range(60):
            if post("/reset_prefix_cache").get("success"):
                break
            time.sleep(0.5)
        else:
            sys.exit("[launch] ERROR: /reset_prefix_cache kept failing")
    for name, parts in REQUESTS:
        before = tier_loads()
        body = {"model": "model", "max_tokens": 4, "temperature": 0, "return_token_ids": True,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]}
        try:
            r = post("/v1/chat/completions", body)
        except Exception as e:  # report every failure, fail at the end
            failed += 1
            detail = e.read().decode()[:500] if hasattr(e, "read") else ""
            print(f"[request] pass {pass_no} {name:>8}: FAILED {e} {detail}")
            continue
        loads = tier_loads() - before
        u = r["usage"]
        d = u.get("prompt_tokens_details") or {}
        ids = r["prompt_token_ids"]
        images = [p for p in parts if p["type"] == "image_url"]
        runs = placeholders(ids, len(images))
        assert len(ids) == u["prompt_tokens"], (len(ids), u["prompt_tokens"])
        assert sum(n for _, n in runs) == ((d.get("multimodal_tokens") or {}).get("image") or 0)
        prompt = {"name": name, "token_ids": ids,
                  "images": [{"offset": o, "length": n, "identifier": img.get("uuid")}
                             for (o, n), img in zip(runs, images)]}
        assert prompts.setdefault(name, prompt) == prompt, f"{name}: prompt changed between passes"
        image_tier_hits += bool(pass_no == 2 and images and loads)
        print(f"[request] pass {pass_no} {name:>8}: prompt_tokens={u['prompt_tokens']} "
              f"cached_tokens={d.get('cached_tokens')} image_tokens={sum(n for _, n in runs)} "
              f"tier_loaded_blocks={int(loads)}")
with open(prompts_path, "w") as fp:
    for p in prompts.values():
        fp.write(json.dumps(p) + "\n")
if not failed and not image_tier_hits:
    print("[launch] ERROR: no image request of pass 2 loaded blocks from the CPU tier")
sys.exit(1 if failed or not image_tier_hits else 0)
PY
then
  echo "[launch] ERROR: requests failed or missed the tier; last server log lines:" >&2
  tail -n 40 "$WORK/server.log" >&2; exit 1
fi
sleep 2
grep -E "KV Transfer metrics" "$WORK/server.log" | tail -n 1 | sed 's/^/[server] /' || true

stop_subscriber
echo "[launch] event summary (validated like a router would, extra_keys against the prompts):"
"$PY" -m vllm_kvbm_plugin.cli validate "$WORK/events.jsonl" --prompts "$WORK/prompts.jsonl" \
  | tee "$WORK/summary.json" || true
"$PY" - "$WORK/subscriber.json" "$WORK/summary.json" <<'PY'
import json, sys
sub = json.load(open(sys.argv[1]))["subscriber"]
rep = json.load(open(sys.argv[2]))
pb = rep["prompt_blocks"]
print(f"[launch] batches received={sub['received']} recovered={sub['recovered']} lost={sub['lost']}; "
      f"validator errors={rep['errors']}; prompt blocks checked={pb['checked']} with images={pb['with_images']}")
sys.exit(1 if rep["errors"] or sub["lost"] or not pb["with_images"] else 0)
PY
