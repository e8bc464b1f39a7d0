"""The multimodal launch script end to end: `vllm serve` on a tiny Qwen2-VL with KVBMConnector and
KV events; text and image chat requests hit the CPU tier, and every prompt block's extra_keys match
the requests' images."""

import json
import os
import pathlib
import re
import subprocess

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_launch_multimodal_script(tmp_path):
    proc = subprocess.run([str(ROOT / "scripts" / "launch_multimodal.sh")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)}, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # pass 2 runs after the engine's prefix cache was reset: image requests load from the CPU tier
    rows = re.findall(r"\[request\] pass 2 +(\S+): prompt_tokens=(\d+) cached_tokens=(\d+) "
                      r"image_tokens=(\d+) tier_loaded_blocks=(\d+)", out)
    assert len(rows) == 5, out[-4000:]
    image_hits = [r for r in rows if int(r[3]) > 0 and int(r[4]) > 0]
    assert image_hits and all(int(r[2]) > 0 for r in image_hits)
    summary = json.loads(out[out.index("{"): out.rindex("}") + 1])
    assert summary["errors"] == 0 and summary["by_rule"]["extra_keys"] == 0
    assert summary["prompt_blocks"]["with_images"] > 0
    assert summary["stored_by"]["CPU/g0/full_attention/32"] > 0
    assert "validator errors=0" in out and "lost=0" in out
    assert not list(tmp_path.glob("kvbm-launch-*")), "the work directory was not cleaned up"
