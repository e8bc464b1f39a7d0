"""A disk that fails as a whole (full, its directory gone) pauses KVBMConnector's disk writes, on
the worker and in the scheduler's disk tier, for tiers.block_file.WRITE_PAUSE_S, then they resume: the
soak of issue 31 filled the disk tier's filesystem for a few seconds, and the tier never stored
again for the rest of the engine's life."""

import os
import time

from vllm_kvbm_plugin.connector.block_events import NOTHING
from vllm_kvbm_plugin.connector.base import TierJob
from vllm_kvbm_plugin.connector.disk_scheduler import DiskTier
from vllm_kvbm_plugin.connector.layout import KV
from vllm_kvbm_plugin.connector.metadata import KVBMMetadata
from vllm_kvbm_plugin.testing.worker import cpu_layout_worker
from vllm_kvbm_plugin.tiers import block_dir, block_file

PAUSE = 0.3


def write(w, key) -> tuple[bool, tuple]:
    """One block file from slot 0; (its WRITE report's ok, the metadata's broken tiers)."""
    w.wait_for_save(KVBMMetadata(jobs=[TierJob(DiskTier.WRITE, key, 0, block_file.encode_meta(32, []))]))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        meta = w.build_worker_meta()
        reports = [r for r in (meta.reports if meta else []) if r.op == DiskTier.WRITE]
        if reports:
            return reports[0].ok, meta.broken
        time.sleep(0.01)
    raise AssertionError("no WRITE report")


def test_worker_disk_writes_resume_after_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(block_file, "WRITE_PAUSE_S", PAUSE, raising=False)
    w, _ = cpu_layout_worker(2, 8, (2, 32, 16), slots=2, disk_path=str(tmp_path))
    w._copy([(KV, (3,), 0)], to_pool=True)
    base = w.tier("disk").base
    os.rename(base, base + ".away")
    open(base, "w").close()  # the tier directory replaced by a file: every write fails, even as root
    ok, broken = write(w, (1, 1))
    assert not ok and broken == ("disk",)
    os.unlink(base)
    os.rename(base + ".away", base)
    ok, broken = write(w, (2, 2))
    assert not ok, "writes stay paused for WRITE_PAUSE_S"
    time.sleep(PAUSE + 0.1)
    ok, broken = write(w, (3, 3))
    assert ok and broken == (), "the disk is back: writes resume"
    assert os.path.exists(block_dir.block_path(base, (3, 3)))


def test_scheduler_disk_tier_stores_again_after_the_pause(tmp_path, monkeypatch):
    monkeypatch.setattr(block_file, "WRITE_PAUSE_S", PAUSE, raising=False)
    w, _ = cpu_layout_worker(2, 8, (2, 32, 16), slots=2, disk_path=str(tmp_path))
    tier = DiskTier(w.layout, "lineage")
    assert tier.prepare_write((1, 1), None, 32, announce=NOTHING) is not None
    tier.worker_failed()
    assert tier.prepare_write((2, 2), None, 32, announce=NOTHING) is None, "paused"
    time.sleep(PAUSE + 0.1)
    assert tier.prepare_write((3, 3), None, 32, announce=NOTHING) is not None, "stores again"
