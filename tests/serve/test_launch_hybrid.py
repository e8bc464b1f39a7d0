"""The launch script end to end: `vllm serve`, KV events over ZMQ, subscriber and validator."""

import json
import os
import pathlib
import re
import subprocess

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_launch_hybrid_script(tmp_path):
    proc = subprocess.run([str(ROOT / "scripts" / "launch_hybrid.sh")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)}, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "hash granularity preserved at 32" in out
    assert "validator errors=0" in out and "lost=0" in out
    summary = json.loads(out[out.index("{"): out.rindex("}") + 1])
    assert summary["stored_by"]["GPU/g1/full_attention/32"] > 0
    cached = [int(c) for c in re.findall(r"long again: prompt_tokens=\d+ cached_tokens=(\d+)", out)]
    assert cached and cached[0] > 0 and cached[0] % 32 == 0
    assert not list(tmp_path.glob("kvbm-launch-*")), "the work directory was not cleaned up"
