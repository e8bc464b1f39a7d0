"""Without redis-py (the `[remote]` extra), every way into the remote tier stops at startup with an
error naming the extra: KVBMConnector's remote_url, KVBMRemoteTier under vLLM's tiering manager,
and `vllm-kvbm announce`. redis-py is made unimportable in a fresh interpreter (a None entry in
sys.modules), not uninstalled."""

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys
sys.modules["redis"] = None  # `import redis` now raises ImportError, as without the extra
out = {}
from vllm_kvbm_plugin.config import KVBMConfig
try:
    KVBMConfig.from_extra({"remote_url": "redis://127.0.0.1:6379/0"})
except ImportError as e:
    out["connector"] = str(e)
from vllm_kvbm_plugin.testing import offloading_drive
try:
    offloading_drive.Tiered({"type": "KVBMRemoteTier", "module_path": "vllm_kvbm_plugin.offloading",
                  "url": "redis://127.0.0.1:6379/0"})
except ImportError as e:
    out["offloading"] = str(e)
from vllm_kvbm_plugin import cli
out["announce_rc"] = cli.main(["announce", "--remote-url", "redis://127.0.0.1:6379/0",
                              "--endpoint", "ipc:///nonexistent/x"])
print(json.dumps(out))
"""


def test_the_remote_tier_without_redis_py_names_the_extra():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for where in ("connector", "offloading"):
        assert "vllm-kvbm-plugin[remote]" in out.get(where, ""), (where, out)
    assert out["announce_rc"] == 2 and "vllm-kvbm-plugin[remote]" in proc.stderr
