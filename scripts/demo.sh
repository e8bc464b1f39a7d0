#!/usr/bin/env bash
# The main job, end to end: `vllm serve` on a tiny hybrid (Mamba+attention) model whose --block-size 32
# vLLM inflates to 160; the plugin keeps hashing at 32 and announces every 32-token unit; a subscriber
# records the KV event stream and validates it like a router would. Prints the event summary.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
exec "$ROOT/scripts/launch_hybrid.sh" "$@"
