import os
import stat

import numpy as np
import pytest

from vllm_kvbm_plugin.tiers import disk
from vllm_kvbm_plugin.tiers.index import TierIndex
from vllm_kvbm_plugin.tiers.policies import LRU, Lineage, MultiLRU, make_policy


def fill(index, keys, parents=None):
    for i, k in enumerate(keys):
        e, evicted = index.reserve(k, (parents or {}).get(k))
        assert e is not None
        index.complete(k)
    return index


def test_lru_evicts_least_recently_used_and_skips_pinned():
    idx = fill(TierIndex(3, LRU()), ["a", "b", "c"])
    idx.touch("a")
    idx.pin("b")
    e, evicted = idx.reserve("d")
    assert [k for k, _ in evicted] == ["c"] and e.slot == evicted[0][1].slot
    idx.unpin("b")
    _, evicted = idx.reserve("e")
    assert [k for k, _ in evicted] == ["b"]


def test_nothing_evictable_means_no_slot():
    idx = TierIndex(1, LRU())
    idx.reserve("a")  # reserved entries start pinned
    assert idx.reserve("b") == (None, [])
    idx.complete("a")
    assert idx.busy() == 0 and idx.reserve("b")[0] is not None


def test_lineage_never_evicts_a_parent_whose_child_is_held():
    # chain a <- b <- c, plus an unrelated x; touching a keeps it hot, yet b/c go first
    idx = fill(TierIndex(4, Lineage()), ["a", "b", "c", "x"], parents={"b": "a", "c": "b"})
    idx.touch("a")
    order = []
    for new in ["n1", "n2", "n3", "n4"]:
        _, evicted = idx.reserve(new)
        idx.complete(new)
        order += [k for k, _ in evicted]
    assert order.index("c") < order.index("b") < order.index("a")  # leaves first
    for k in order:  # at each eviction the victim had no child left
        assert k not in ("a", "b") or order.index("c") < order.index(k)


def test_multi_lru_keeps_frequent_entries_and_refuses_cold_newcomers():
    pol = MultiLRU(sketch_width=256)
    idx = fill(TierIndex(2, pol), ["hot", "warm"])
    for _ in range(8):
        idx.touch("hot")
    pol.record_miss("new1")  # requested twice before it is stored: TinyLFU learns from misses
    pol.record_miss("new1")
    e, evicted = idx.reserve("new1")
    assert [k for k, _ in evicted] == ["warm"]
    idx.complete("new1")
    # a one-off key may not displace an entry accessed more often than it
    for _ in range(3):
        idx.touch("new1")
    e, evicted = idx.reserve("one-off")
    assert e is None and evicted == [] and "hot" in idx and "new1" in idx
    with pytest.raises(ValueError, match="valid: lru, lineage, multi_lru"):
        make_policy("fifo")


KEY, FP = (0x0123456789ABCDEF, 0xFEDCBA9876543210), bytes(range(16))


def write(tmp_path, payload):
    base = disk.block_dir(str(tmp_path), FP, 0)
    path = disk.block_path(base, KEY)
    disk.write_atomic(path, disk.encode(KEY, FP, payload, b"meta"))
    return base, path


def test_disk_round_trip_permissions_and_atomicity(tmp_path):
    payload = np.frombuffer(os.urandom(4096), dtype=np.uint8)
    base, path = write(tmp_path, payload)
    assert os.path.basename(path) == disk.key_hex(KEY) + ".kvb"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    out = np.empty(4096, dtype=np.uint8)
    assert disk.read_into(path, KEY, FP, out) == b"meta" and (out == payload).all()
    open(path + ".tmp123", "wb").write(b"partial")  # a crash mid-write leaves only a temp file
    assert disk.scan(base) == [(KEY, os.path.getsize(path))]
    assert not os.path.exists(path + ".tmp123")


def test_disk_corruption_is_a_miss(tmp_path):
    payload = np.frombuffer(os.urandom(4096), dtype=np.uint8)
    _, path = write(tmp_path, payload)
    good = open(path, "rb").read()
    out = np.empty(4096, dtype=np.uint8)

    def read_with(data, key=KEY, fp=FP, size=4096):
        open(path, "wb").write(data)
        return disk.read_into(path, key, fp, np.empty(size, dtype=np.uint8))

    flipped = bytearray(good)
    flipped[-100] ^= 1
    assert read_with(bytes(flipped)) is None  # flipped payload byte
    flipped = bytearray(good)
    flipped[disk.HEADER_SIZE + 1] ^= 1
    assert read_with(bytes(flipped)) is None  # flipped metadata byte
    assert read_with(good[:-1]) is None  # truncated
    assert read_with(good + b"x") is None  # trailing garbage
    assert read_with(good, key=(1, 2)) is None  # another key's file
    assert read_with(good, fp=bytes(16)) is None  # another model / layout
    assert read_with(good, size=8192) is None  # another block size
    assert read_with(good) == b"meta"
    os.unlink(path)
    assert disk.read_into(path, KEY, FP, out) is None  # deleted
