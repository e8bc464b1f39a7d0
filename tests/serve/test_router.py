"""`vllm-kvbm route` end to end (scripts/launch_router.sh): two `vllm serve` workers on tiny
Qwen3-Next, a workload of shared prefixes routed KV-aware and round-robin in the same run, then a
text prompt (tokenized through a worker) plain and streamed."""

import os
import pathlib
import re
import subprocess

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[2]
REQUEST = re.compile(r"\[request\] #\s*\d+\s+(\S+): worker (\d) prompt_tokens=(\d+) predicted=(\d+) served=(\S+)")


def test_router_beats_round_robin_and_predicts_exactly(tmp_path):
    proc = subprocess.run([str(ROOT / "scripts" / "launch_router.sh")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)}, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = REQUEST.findall(out)
    assert len(rows) == 30, out[-4000:]  # 5 prefixes x 3 rounds, per policy
    served = {"kv": 0, "round-robin": 0}
    for policy, worker, _, predicted, got in rows:
        assert got != "None", f"no cached_tokens in a response: {out[-4000:]}"
        assert int(predicted) == int(got), f"prediction {predicted} != served {got} ({policy})"
        served[policy] += int(got)
    assert {w for p, w, *_ in rows if p == "kv"} == {"0", "1"}, "the router used one worker only"
    assert served["round-robin"] > 0 and served["kv"] >= 1.5 * served["round-robin"], served
    assert f"kv={served['kv']} round-robin={served['round-robin']}" in out
    # a text prompt tokenized through a worker, then the same streamed: the second is a hit, predicted
    text = re.findall(r"\[text(, streamed)?\] worker \d prompt_tokens=(\d+) predicted=(\d+) served=(\d+)", out)
    assert len(text) == 2, out[-2000:]
    (_, n, p1, s1), (_, _, p2, s2) = text
    assert (p1, s1) == ("0", "0") and p2 == s2 and 0 < int(s2) < int(n)
    assert not list(tmp_path.glob("kvbm-router-*")), "the work directory was not cleaned up"
