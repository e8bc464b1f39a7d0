#!/usr/bin/env bash
# A separate venv for the Dynamo side-by-side index benchmark (bench_index.py): ai-dynamo-runtime is
# never a project dependency. It reuses the project venv's packages (numpy, numba, this package,
# pydantic) through a .pth file and adds the ai-dynamo-runtime wheel alone, so the project venv
# stays untouched. Idempotent. Prints the venv's path:
#   $(benchmarks/dynamo_venv.sh)/bin/python benchmarks/bench_index.py
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PROJECT_VENV=${PROJECT_VENV:-$ROOT/.venv}
if [ ! -x "$PROJECT_VENV/bin/python" ]; then
  echo "no project venv at $PROJECT_VENV: run scripts/setup.sh first (or set PROJECT_VENV)" >&2
  exit 1
fi
V=$ROOT/benchmarks/.venv-dynamo
if ! "$V/bin/python" -c 'import dynamo._core' 2>/dev/null; then
  "$PROJECT_VENV/bin/python" -m venv --without-pip "$V"
  site=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir also runs the project venv's own .pth files (the editable install of this package)
  "$PROJECT_VENV/bin/python" -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' > "$site/project-venv.pth"
  # --no-deps: its requirements (pydantic, uvloop) are only for its runtime, not for RadixTree
  "$PROJECT_VENV/bin/python" -m pip install -q --no-deps --target "$site" "ai-dynamo-runtime==1.6.1"
fi
echo "$V"
