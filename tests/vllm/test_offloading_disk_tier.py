"""KVBMDiskTier as a secondary tier of vLLM's own TieringOffloadingManager (in-process, 0.32 and 0.33):
stores cascade from vLLM's CPU primary tier to our files, hits are promoted back through it; bad
files are misses, never bytes, never an exception."""

import contextlib
import os
import subprocess

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, Medium

from vllm_kvbm_plugin.offloading.disk_tier import file_key
from vllm_kvbm_plugin.testing import offloading_drive
from vllm_kvbm_plugin.testing.offloading_drive import Request, chunk_key, payload
from vllm_kvbm_plugin.tiers import block_dir, block_file

CHUNK = 4096


def Tiered(path, cpu_chunks=8, bytes_to_use=1 << 20, policy="lineage", cpu_policy="lru", **opts) -> offloading_drive.Tiered:
    """vLLM's tiering manager with our disk tier at `path`, and the calls the connector makes."""
    return offloading_drive.Tiered({"type": "KVBMDiskTier", "module_path": "vllm_kvbm_plugin.offloading", "path": str(path),
                         "bytes_to_use": bytes_to_use, "eviction_policy": policy, **opts}, cpu_chunks, CHUNK, cpu_policy)


def keys_of(name, n):
    return [chunk_key(f"{name}{i}") for i in range(n)]


def assert_exact(served: dict, hits: list, misses: list = ()):
    for k in hits:
        assert served[k] is not None and np.array_equal(served[k], payload(k))
    for k in misses:
        assert served[k] is None


def test_store_lookup_load_through_the_cpu_primary_tier(tiered, tmp_path):
    t = tiered(tmp_path)
    keys = keys_of("a", 5)
    t.store(keys, per_step=2)
    stored = t.storage_events(removed=False)
    assert stored == keys  # announced once each, in order, once the files are in place
    ev = next(e for e in t.events if e.medium is Medium.STORAGE)
    assert ev.locality.value == "LOCAL" and ev.ownership == t.tier.ownership and ev.removal_expected
    files = [p for p in (tmp_path.rglob("*.kvb"))]
    assert len(files) == 5
    assert_exact(t.load(keys), keys)
    assert t.tier.index.busy() == 0


def test_restart_on_the_same_path_hits(tiered, tmp_path):
    keys = keys_of("r", 4)
    t = tiered(tmp_path)
    t.store(keys)
    t.close()
    t2 = tiered(tmp_path)
    t2.settle()
    assert t2.storage_events(removed=False) == keys  # the restart index is announced, parents first
    assert t2.tier.ownership == t.tier.ownership  # a tier id stable across restarts
    assert_exact(t2.load(keys), keys)
    lin = t2.tier.index.policy
    assert lin._parent[keys[1]] == keys[0]  # lineage links survive a restart


def corrupt_flip(path, where):
    size = os.path.getsize(path)
    offset = {"header": 20, "first": block_file.HEADER_SIZE, "sign": block_file.HEADER_SIZE + 1001,
              "last": block_file.HEADER_SIZE + CHUNK - 1, "meta": size - 2}[where]
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x80]))


@pytest.mark.parametrize("fault", ["flip-header", "flip-first", "flip-sign", "flip-last", "flip-meta",
                                   "truncate", "delete", "swap"])
def test_bad_files_are_misses_never_bytes(tiered, tmp_path, fault):
    keys = keys_of("c", 4)
    t = tiered(tmp_path)
    t.store(keys)
    victim = keys[2]
    path = block_dir.block_path(t.tier.base, file_key(victim))
    if fault.startswith("flip"):
        corrupt_flip(path, fault.split("-")[1])
    elif fault == "truncate":
        os.truncate(path, os.path.getsize(path) - 100)
    elif fault == "delete":
        os.unlink(path)
    else:  # another chunk's valid file under this chunk's name
        os.replace(block_dir.block_path(t.tier.base, file_key(keys[3])), path)
    served = t.load(keys)
    assert_exact(served, keys[:2], [victim])
    assert victim not in t.tier.index and victim in t.storage_events(removed=True)
    assert t.tier.failed_loads >= 1 and t.tier.index.busy() == 0
    assert t.m.primary_tier.lookup(victim, Request(t.m, [victim]).ctx) is LookupResult.MISS
    again = t.load(keys)  # the tier forgot it: a plain miss now, nothing pending
    assert again[victim] is None
    assert fault == "swap" or not os.path.exists(path)  # a bad file is removed


def test_capacity_bound_evicts_by_our_policy(tiered, tmp_path):
    file_bytes = block_file.file_footprint(CHUNK, 128)  # what the tier counts a file as
    t = tiered(tmp_path, bytes_to_use=4 * file_bytes, policy="lineage")
    a, b = keys_of("a", 3), keys_of("b", 3)
    t.store(a)
    t.store(b)
    assert len(list(tmp_path.rglob("*.kvb"))) <= 4 and len(t.tier.index) <= 4
    removed = t.storage_events(removed=True)
    assert removed and all(k in a for k in removed)
    # lineage: a chain loses its tail first; what remains of chain a is a prefix
    left = [k in t.tier.index for k in a]
    assert left == sorted(left, reverse=True)
    served = t.load(b)
    assert_exact(served, b)


def test_abandoned_temp_files_and_foreign_entries_do_not_stop_a_restart(tiered, tmp_path):
    keys = keys_of("f", 2)
    t = tiered(tmp_path)
    t.store(keys)
    t.close()
    sub = os.path.dirname(block_dir.block_path(t.tier.base, file_key(keys[0])))
    tmp = os.path.join(sub, os.path.basename(block_dir.block_path(t.tier.base, file_key(keys[0]))) + ".tmp1.ab")
    with open(tmp, "wb") as f:
        f.write(b"half a block")
    fifo = block_dir.block_path(t.tier.base, (7, 7))  # a FIFO named like a block file: never opened
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    os.mkfifo(fifo)
    t2 = tiered(tmp_path)
    assert not os.path.exists(tmp)  # a crash's leftover, nobody writes it any more
    assert_exact(t2.load(keys), keys)
    assert os.path.exists(fifo)  # not ours: left alone


@contextlib.contextmanager
def tmpfs(path, size: str):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def direct_chunks(monkeypatch):
    """O_DIRECT writes for the tests' 4 KiB chunks too (by default only payloads of 64 KiB or more)."""
    monkeypatch.setattr(block_file, "_DIRECT_MIN", CHUNK)


def test_one_jobs_files_spread_over_the_threads_and_direct_io(tiered, tmp_path, direct_chunks):
    t = tiered(tmp_path, cpu_chunks=16, direct_io=True, threads=4)
    keys = keys_of("p", 16)
    t.store(keys)  # one step: one store job of 16 chunks, in 4 parts
    assert t.storage_events(removed=False) == keys  # one Stored each, in the job's order
    base = t.tier.base
    assert base not in block_file._no_direct
    for k in keys:  # each file exactly the reference encoding (the O_DIRECT page padding cut off)
        path = block_dir.block_path(base, file_key(k))
        assert os.path.getsize(path) == block_file.HEADER_SIZE + CHUNK + len(block_file.read_meta(path))
    assert_exact(t.load(keys), keys)  # one load job, in 4 parts
    corrupt_flip(block_dir.block_path(base, file_key(keys[5])), "sign")
    t.close()
    t2 = tiered(tmp_path, cpu_chunks=16, direct_io=True, threads=4)
    assert_exact(t2.load(keys), keys[:5] + keys[6:], [keys[5]])


@pytest.mark.parametrize("direct_io", [False, True], ids=["page-cache", "direct"])
def test_full_disk_is_misses_not_errors(tiered, tmp_path, direct_chunks, direct_io):
    with tmpfs(tmp_path / "small", "48k") as small:
        # the bound is far above the space
        t = tiered(small, cpu_chunks=16, bytes_to_use=1 << 20, direct_io=direct_io)
        keys = keys_of("d", 16)
        t.store(keys, per_step=4)
        assert t.tier.failed_writes > 0
        on_disk = [k for k in keys if k in t.tier.index]
        assert 0 < len(on_disk) < len(keys)
        assert t.storage_events(removed=False) == on_disk  # only what landed was announced
        served = t.load(keys)
        assert_exact(served, on_disk, [k for k in keys if k not in on_disk])


def test_read_only_directory_is_misses_not_errors(tiered, tmp_path):
    with tmpfs(tmp_path / "ro", "1m") as ro:
        t = tiered(ro)
        old = keys_of("o", 2)
        t.store(old)
        r = subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only: {r.stderr.decode().strip()}")
        new = keys_of("n", 2)
        t.store(new)
        assert t.tier.failed_writes == 2 and all(k not in t.tier.index for k in new)
        assert_exact(t.load(old + new), old, new)
        t.close()
        t2 = tiered(ro)  # starting on a read-only directory: serves what it holds
        assert_exact(t2.load(old), old)
        t2.store(keys_of("m", 1))
        assert t2.tier.failed_writes + (t2.tier._writes_paused_until > 0) >= 1
