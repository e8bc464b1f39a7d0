"""The disk tier stays within disk_bytes_to_use as `du` counts it: a block file takes its header,
payload and metadata rounded up to whole file-system blocks, and the tier holds only as many files
as fit (issue 31's soak found it ~3 % over: slots were disk_bytes_to_use // payload). An entry whose
metadata would take more than its file's share is not written. vLLM's real Scheduler with real
WorkerSides writing real files; runs on vLLM 0.32 and 0.33."""

import os
import random

from vllm_kvbm_plugin.connector.block_events import NOTHING
from vllm_kvbm_plugin.connector.disk_scheduler import DiskTier
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness
from vllm_kvbm_plugin.testing.worker import cpu_layout_worker
from vllm_kvbm_plugin.tiers import block_dir

BLOCK = 32


def du(root) -> tuple[int, int]:
    """(bytes the block files under `root` take on disk, their number)."""
    taken, n = 0, 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(block_dir.SUFFIX):
                taken += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                n += 1
    return taken, n


def test_disk_tier_files_stay_within_disk_bytes_to_use(tmp_path):
    rng = random.Random(3)
    h = SchedulerHarness(HarnessConfig(hybrid=False, block_size=BLOCK, hash_block_size=None, num_blocks=64,
                                       connector={"cpu_bytes_to_use": 1 << 24}))
    payload = h.connector.layout.slot_bytes
    budget = 6 * payload  # six payloads: five files, with their headers and metadata
    h = SchedulerHarness(HarnessConfig(hybrid=False, block_size=BLOCK, hash_block_size=None, num_blocks=64,
                                       connector={"cpu_bytes_to_use": 1 << 24, "disk_path": str(tmp_path),
                                                  "disk_bytes_to_use": budget}))
    slots = h.connector.layout.disk_slots
    assert 0 < slots < 6
    for _ in range(4):  # 4 x 3 full blocks: more than the tier holds, so it evicts
        h.serve([rng.randrange(10, 2000) for _ in range(3 * BLOCK + 1)])
    h.settle()
    taken, files = du(tmp_path)
    assert files == slots, "the tier is full"
    assert taken <= budget


def test_an_entry_whose_metadata_does_not_fit_is_not_written(tmp_path):
    w, _ = cpu_layout_worker(2, 8, (2, 32, 16), slots=2, disk_path=str(tmp_path))
    tier = DiskTier(w.layout, "lru")
    assert tier.prepare_write((1, 1), None, 32, announce=NOTHING) is not None
    tier.meta_bytes = 8  # less than any metadata blob
    assert tier.prepare_write((2, 2), None, 32, announce=NOTHING) is None
    assert (2, 2) not in tier and tier.oversized == 1 and tier.busy() == 1  # only (1, 1)'s write is open
