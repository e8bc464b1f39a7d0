"""The 2-minute soak of benchmarks/soak.py (issue 31): `vllm serve` with KVBMConnector's CPU, disk
(a tmpfs when root) and redis-server tiers under client load while every fault kind strikes once
(Redis killed and paused, disk files truncated, flipped, deleted, replaced by a FIFO or a symlink,
the disk full, the engine SIGKILLed and restarted). Every completion must equal a reference server's
greedy tokens; no HTTP error outside the engine's restart window, no hang, disk within its bound,
RSS and fds flat, event streams valid; the CPU, disk and remote tiers each served hits, and the
negative control (forged disk blocks served on purpose after the restart) was caught as a mismatch.
~3.5 min wall here (two servers start in parallel)."""

import pathlib
import subprocess
import sys

import pytest

from vllm_kvbm_plugin.testing.redis_server import server_binary

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(server_binary() is None, reason="no redis-server (scripts/setup.sh installs Debian's)")
def test_two_minute_soak_with_every_fault(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "2", "--repeat", "1",
                           "--warmup-s", "10", "--after-restart-s", "10", "--json", str(out)],
                          capture_output=True, text=True, timeout=840, cwd=ROOT)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "[soak]" in proc.stdout and "FAIL" not in proc.stdout, report
    assert proc.returncode == 0, report
    for kind in ("redis_kill", "redis_pause", "disk_truncate", "disk_flip", "disk_delete", "disk_fifo",
                 "disk_symlink", "disk_full", "engine_kill"):
        assert f" {kind}: " in proc.stdout, f"{kind} never struck:\n{report}"
    for tier in ("cpu", "disk", "remote"):
        assert f"[PASS] the {tier} tier served hits" in proc.stdout, report
    assert "[PASS] negative control" in proc.stdout and "negative control: mismatch (expected)" in proc.stdout, report
