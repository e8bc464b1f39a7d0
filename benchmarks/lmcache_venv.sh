#!/usr/bin/env bash
# A separate venv for the LMCache side-by-side benchmark: LMCache is never a project dependency.
# It reuses the project venv's packages (vLLM, torch) through a .pth file and adds lmcache 0.5.6
# and the two imports it misses, so the project venv stays untouched. Idempotent.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
V=$ROOT/benchmarks/.venv-lmcache
if [ ! -x "$V/bin/lmcache" ]; then
  python3 -m venv "$V"
  site=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir also runs the project venv's own .pth files (the editable install of this package)
  "$ROOT/.venv/bin/python" -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' > "$site/project-venv.pth"
  "$V/bin/python" -m pip install -q --no-deps "lmcache==0.5.6" sortedcontainers aiofile caio
fi
echo "$V"
