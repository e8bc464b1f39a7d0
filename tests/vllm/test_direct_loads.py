"""The worker side of direct disk loads on real files and real CPU-layout KV tensors: a verified
block file held open is read straight into a KV block, even after the file was unlinked; a load
with no verified file behind it is reported to vLLM as a load error."""

import os

import numpy as np
import torch

from vllm_kvbm_plugin.connector.layout import KV
from vllm_kvbm_plugin.connector.base import Report, TierJob
from vllm_kvbm_plugin.connector.disk_scheduler import DiskTier
from vllm_kvbm_plugin.connector.metadata import STORE, Copies, DirectLoad, KVBMMetadata
from vllm_kvbm_plugin.testing.worker import cpu_layout_worker
from vllm_kvbm_plugin.tiers import block_dir, block_file


def test_direct_load_reads_the_verified_file_into_the_block(tmp_path):
    # slots longer than an entry, as when a hybrid model's state entries are the larger kind
    w, buf = cpu_layout_worker(2, 8, (2, 32, 16), slots=2, extra_slot_bytes=64, disk_path=str(tmp_path))
    key = (7, 9)
    w._copy([(KV, (3,), 0)], to_pool=True)  # block 3 -> slot 0 -> a block file
    path = block_dir.block_path(w.tier("disk").base, key)
    block_file.write_block(path, key, w.fingerprint, w.mac_key, w.pool[0].numpy())
    buf[:, 5].zero_()

    w.start_load_kv(KVBMMetadata(jobs=[TierJob(DiskTier.OPEN, key)]))
    assert w.build_worker_meta().reports == [Report(DiskTier.OPEN, key, True)] and key in w.tier("disk").held
    os.unlink(path)  # evicted by someone else: the open file still reads
    w.start_load_kv(KVBMMetadata(direct_loads=[DirectLoad(KV, (5,), key, "disk")], jobs=[TierJob(DiskTier.CLOSE, key)]))
    assert torch.equal(buf[:, 5], buf[:, 3]) and not w.tier("disk").held
    assert w.take_load_errors() == set()
    assert w.get_stats().data["disk_load_blocks"] == 1

    w.start_load_kv(KVBMMetadata(direct_loads=[DirectLoad(KV, (6,), key, "disk")]))  # no file held: a load error
    assert w.take_load_errors() == {6} and w.take_load_errors() == set()


def test_a_file_that_fails_verification_is_not_held(tmp_path):
    w, _ = cpu_layout_worker(2, 8, (2, 32, 16), slots=2, disk_path=str(tmp_path))
    key = (1, 1)
    path = block_dir.block_path(w.tier("disk").base, key)
    block_file.write_block(path, key, w.fingerprint, w.mac_key, np.zeros(w.slot_bytes, np.uint8))
    data = bytearray(open(path, "rb").read())
    data[block_file.HEADER_SIZE + 5] ^= 1
    open(path, "wb").write(data)
    w.start_load_kv(KVBMMetadata(jobs=[TierJob(DiskTier.OPEN, key), TierJob(DiskTier.OPEN, (2, 2))]))  # corrupt, missing
    assert w.build_worker_meta().reports == [Report(DiskTier.OPEN, key, False), Report(DiskTier.OPEN, (2, 2), False)]
    assert not w.tier("disk").held


def test_a_step_whose_load_failed_stores_and_writes_nothing(tmp_path):
    """A held file changed in place before its direct load: the load fails and the step's stores
    (which would copy the failed block, or blocks the forward computed from it, into the pool)
    fail as one report, and the disk writes behind them are not made; the next step stores again."""
    w, buf = cpu_layout_worker(2, 8, (2, 32, 16), slots=2, disk_path=str(tmp_path))
    key, other = (7, 9), (8, 8)
    w._copy([(KV, (3,), 0)], to_pool=True)
    path = block_dir.block_path(w.tier("disk").base, key)
    block_file.write_block(path, key, w.fingerprint, w.mac_key, w.pool[0].numpy())
    w.start_load_kv(KVBMMetadata(jobs=[TierJob(DiskTier.OPEN, key)]))
    w.build_worker_meta()
    with open(path, "r+b") as f:  # flipped in place after verification
        f.seek(block_file.HEADER_SIZE + 1)
        b = f.read(1)
        f.seek(block_file.HEADER_SIZE + 1)
        f.write(bytes([b[0] ^ 0x20]))
    pool_before = w.pool[1].clone()
    step = KVBMMetadata(direct_loads=[DirectLoad(KV, (5,), key, "disk")], stores={KV: Copies(KV, ([5],), [1])},
                        store_batch=4, jobs=[TierJob(DiskTier.WRITE, other, 1, b"meta")])
    w.start_load_kv(step)
    w.wait_for_save(step)
    wm = w.build_worker_meta()
    assert w.take_load_errors() == {5}
    assert wm.reports == [Report(STORE, 4, False), Report(DiskTier.WRITE, other, False)]
    assert torch.equal(w.pool[1], pool_before) and not os.path.exists(block_dir.block_path(w.tier("disk").base, other))
    step = KVBMMetadata(stores={KV: Copies(KV, ([5],), [1])}, store_batch=5)  # a step without failures
    w.start_load_kv(step)
    w.wait_for_save(step)
    assert w.build_worker_meta().reports == [Report(STORE, 5, True)]
    assert torch.equal(w.pool[1].view(torch.bfloat16).view(2, -1)[0], buf[0, 5].reshape(-1))


def test_staged_direct_loads_land_like_the_cpu_path(tmp_path):
    """CUDA's direct loads (WorkerSide.load_direct_staged), run on the CPU engine: files read into the
    pool's staging rows in batches (here 2 rows for 3 loads) and moved into their blocks by load
    jobs give the bytes the CPU path reads straight into the pages; a file changed in place after
    its verification is a load error and its block is left to vLLM's recompute."""
    from vllm_kvbm_plugin.tiers.transfer import TransferEngine

    w, buf = cpu_layout_worker(2, 12, (2, 32, 16), slots=2, disk_path=str(tmp_path))
    keys = [(1, k) for k in range(4)]
    for k, key in enumerate(keys):  # blocks 0-3 -> files
        w._copy([(KV, (k,), 0)], to_pool=True)
        block_file.write_block(block_dir.block_path(w.tier("disk").base, key), key, w.fingerprint, w.mac_key, w.pool[0].numpy())
    w.start_load_kv(KVBMMetadata(jobs=[TierJob(DiskTier.OPEN, key) for key in keys]))
    with open(block_dir.block_path(w.tier("disk").base, keys[1]), "r+b") as f:  # flipped after verification
        f.seek(block_file.HEADER_SIZE + 3)
        f.write(b"\xff\x00")
    want = buf.clone()
    # the pool as register_kv_caches makes it on CUDA: staging rows past the CPU tier's slots
    w.direct_rows = 2
    w.pool = torch.zeros(w.layout.cpu_slots + w.direct_rows, w.slot_bytes, dtype=torch.uint8)
    w.copies = TransferEngine(w.layers, w.pool)
    w.load_direct_staged([DirectLoad(KV, (8 + k,), key, "disk") for k, key in enumerate(keys)])
    assert w.take_load_errors() == {9}
    for k in (0, 2, 3):
        assert torch.equal(buf[:, 8 + k].view(torch.int16), want[:, k].view(torch.int16))
    assert torch.equal(buf[:, 9].view(torch.int16), want[:, 9].view(torch.int16))  # nothing loaded there
