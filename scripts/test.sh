#!/usr/bin/env bash
# Every test: pure units, vLLM's real scheduler in-process, real engines, multi-process and `vllm serve`.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -k validator, ./scripts/test.sh -m "not slow").
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
cd "$ROOT"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export KVBM_TINY_MODELS=${KVBM_TINY_MODELS:-$ROOT/.cache/tiny-models}
exec "$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider --timeout 900 -q -rs "$@" tests
