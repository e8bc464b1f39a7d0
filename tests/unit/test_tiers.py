import os
import stat
import threading

import numpy as np
import pytest

from vllm_kvbm_plugin.testing.files import reference_mac, write_reference
from vllm_kvbm_plugin.tiers import block_dir, block_file, mac
from vllm_kvbm_plugin.tiers import copy as tcopy
from vllm_kvbm_plugin.tiers.index import TierIndex
from vllm_kvbm_plugin.tiers.pinned import PinnedStores
from vllm_kvbm_plugin.tiers.policies import LRU, Lineage, MultiLRU, make_policy


def fill(index, keys, parents=None):
    for i, k in enumerate(keys):
        e, evicted = index.reserve(k, (parents or {}).get(k))
        assert e is not None
        index.complete(e)
    return index


def test_lru_evicts_least_recently_used_and_skips_pinned():
    idx = fill(TierIndex(3, LRU()), ["a", "b", "c"])
    idx.touch("a")
    b = idx.pin("b")
    e, evicted = idx.reserve("d")
    assert [k for k, _ in evicted] == ["c"] and e.slot == evicted[0][1].slot
    idx.unpin(b)
    _, evicted = idx.reserve("e")
    assert [k for k, _ in evicted] == ["b"]


def test_nothing_evictable_means_no_slot():
    idx = TierIndex(1, LRU())
    a, _ = idx.reserve("a")  # reserved entries start pinned
    assert idx.reserve("b") == (None, [])
    idx.complete(a)
    assert idx.busy() == 0 and idx.reserve("b")[0] is not None


def test_removing_a_pinned_entry_frees_its_slot_at_its_last_unpin():
    idx = fill(TierIndex(1, LRU()), ["a"])
    load = idx.pin("a")  # a load (or a write) reads the slot
    assert idx.remove("a") is load and "a" not in idx
    assert idx.reserve("b") == (None, []) and idx.busy() == 1  # the slot is still being read
    idx.unpin(load)
    b, _ = idx.reserve("b")
    assert b.slot == load.slot and idx.busy() == 1
    idx.unpin(load)  # a pin released twice: nothing more
    assert idx.busy() == 1 and idx.reserve("c") == (None, [])


def test_a_late_unpin_releases_the_old_entry_not_a_new_one_of_the_same_key():
    """A store of `k` fails (dropped) while a write from its slot is in flight; `k` is stored anew;
    then the write's late report unpins: the old entry's slot is freed, the new entry stays pinned
    by its own store (never evicted meanwhile)."""
    idx = TierIndex(2, LRU())
    stores = PinnedStores(idx)
    old, _ = stores.reserve("k")
    write = idx.pin("k")
    assert stores.settle("k", False) == (None, None) and "k" not in idx
    new, _ = stores.reserve("k")
    assert new is not old and new.slot != old.slot  # the old slot is still the write's source
    idx.unpin(write)  # the late report
    assert new.pins == 1 and idx.busy() == 1
    x = fill(idx, ["x"]).entries["x"]
    assert x.slot == old.slot  # the freed slot
    y, evicted = idx.reserve("y")
    assert [k for k, _ in evicted] == ["x"] and idx.entries["k"] is new  # the new entry is not evictable
    entry, _ = stores.settle("k", True)
    assert entry is new and new.ready and new.pins == 0


def test_lineage_never_evicts_a_parent_whose_child_is_held():
    # chain a <- b <- c, plus an unrelated x; touching a keeps it hot, yet b/c go first
    idx = fill(TierIndex(4, Lineage()), ["a", "b", "c", "x"], parents={"b": "a", "c": "b"})
    idx.touch("a")
    order = []
    for new in ["n1", "n2", "n3", "n4"]:
        e, evicted = idx.reserve(new)
        idx.complete(e)
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
    idx.complete(e)
    # a one-off key may not displace an entry accessed more often than it
    for _ in range(3):
        idx.touch("new1")
    e, evicted = idx.reserve("one-off")
    assert e is None and evicted == [] and "hot" in idx and "new1" in idx
    with pytest.raises(ValueError, match="valid: lru, lineage, multi_lru"):
        make_policy("fifo")


KEY, FP = (0x0123456789ABCDEF, 0xFEDCBA9876543210), bytes(range(16))
MK = mac.mac_key(bytes(range(16, 32)))


def write(tmp_path, payload):
    base = block_dir.block_dir(str(tmp_path), FP, 0)
    path = block_dir.block_path(base, KEY)
    write_reference(path, block_file.encode(KEY, FP, MK, payload, b"meta"))
    return base, path


def test_disk_round_trip_permissions_and_atomicity(tmp_path):
    payload = np.frombuffer(os.urandom(4096), dtype=np.uint8)
    base, path = write(tmp_path, payload)
    assert os.path.basename(path) == block_dir.key_hex(KEY) + ".kvb"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    out = np.empty(4096, dtype=np.uint8)
    assert block_file.read_into(path, KEY, FP, MK, out) == b"meta" and (out == payload).all()
    open(path + ".tmp123", "wb").write(b"partial")  # a crash mid-write leaves only a temp file
    assert block_dir.scan(base) == [(KEY, os.path.getsize(path))]
    assert not os.path.exists(path + ".tmp123")


def test_disk_corruption_is_a_miss(tmp_path):
    payload = np.frombuffer(os.urandom(4096), dtype=np.uint8)
    _, path = write(tmp_path, payload)
    good = open(path, "rb").read()
    out = np.empty(4096, dtype=np.uint8)

    def read_with(data, key=KEY, fp=FP, size=4096):
        open(path, "wb").write(data)
        return block_file.read_into(path, key, fp, MK, np.empty(size, dtype=np.uint8))

    flipped = bytearray(good)
    flipped[-100] ^= 1
    assert read_with(bytes(flipped)) is None  # flipped payload byte
    flipped = bytearray(good)
    flipped[block_file.HEADER_SIZE + 1] ^= 1
    assert read_with(bytes(flipped)) is None  # flipped metadata byte
    assert read_with(good[:-1]) is None  # truncated
    assert read_with(good + b"x") is None  # trailing garbage
    assert read_with(good, key=(1, 2)) is None  # another key's file
    assert read_with(good, fp=bytes(16)) is None  # another model / layout
    assert read_with(good, size=8192) is None  # another block size
    assert read_with(good) == b"meta"
    os.unlink(path)
    assert block_file.read_into(path, KEY, FP, MK, out) is None  # deleted


# ---- CPU tier copies (tiers/copy.py) and the faster disk paths --------------------------------

def _layers(rng, n_blocks, widths):
    return [rng.integers(0, 2**63, n_blocks * w, dtype=np.int64).view(np.uint64) for w in widths]


@pytest.mark.parametrize("stream", [False, True])
def test_copy_kernels_are_bit_exact(stream):
    # odd word counts and offsets: streaming stores need a head and a tail around 64-byte lines
    rng = np.random.default_rng(0)
    widths, n_blocks, n_slots = [13, 64, 1, 37], 9, 6
    total = sum(widths) + 3
    offsets = np.cumsum([0] + widths[:-1]) + 1
    layers = _layers(rng, n_blocks, widths)
    pool = np.zeros(n_slots * total, np.uint64)
    ids, slots = np.array([7, 0, 3, 8], np.int64), np.array([5, 1, 0, 2], np.int64)
    for pages, w, off in zip(layers, widths, offsets):
        tcopy.rows_to_slots(pages, w, ids, pool, total, slots, off, stream)
    expect = np.zeros_like(pool).reshape(n_slots, total)
    for pages, w, off in zip(layers, widths, offsets):
        expect[slots, off : off + w] = pages.reshape(n_blocks, w)[ids]
    assert (pool.reshape(n_slots, total) == expect).all()  # nothing outside the parts written
    back = [np.zeros_like(p) for p in layers]
    for pages, w, off in zip(back, widths, offsets):
        tcopy.slots_to_rows(pool, total, slots, off, pages, w, ids, stream)
    for got, src, w in zip(back, layers, widths):
        want = np.zeros_like(src).reshape(n_blocks, w)
        want[ids] = src.reshape(n_blocks, w)[ids]
        assert (got.reshape(n_blocks, w) == want).all()


def test_copy_kernels_refuse_out_of_range_ids():
    pages, pool = np.zeros(4 * 8, np.uint64), np.zeros(2 * 8, np.uint64)
    with pytest.raises(IndexError):
        tcopy.rows_to_slots(pages, 8, np.array([4], np.int64), pool, 8, np.array([0], np.int64), 0)
    with pytest.raises(IndexError):
        tcopy.slots_to_rows(pool, 8, np.array([2], np.int64), 0, pages, 8, np.array([0], np.int64))
    with pytest.raises(IndexError):
        tcopy.rows_to_slots(pages, 8, np.array([-1], np.int64), pool, 8, np.array([0], np.int64), 0, True)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("to_pool", [True, False])
def test_copy_pages_split_over_threads_is_bit_exact(monkeypatch, threads, to_pool):
    monkeypatch.setattr(tcopy, "MIN_SPLIT_BYTES", 64)  # split even these small copies
    seen = set()
    run_part = tcopy._run_part

    def spy(*args):
        seen.add(threading.get_ident())
        run_part(*args)

    monkeypatch.setattr(tcopy, "_run_part", spy)
    rng = np.random.default_rng(threads)
    widths, n_blocks, n_slots = [24, 8, 40], 64, 40
    total, offsets = sum(widths), np.cumsum([0] + widths[:-1])
    layers = _layers(rng, n_blocks, widths)
    pool = rng.integers(0, 2**63, n_slots * total, dtype=np.int64).view(np.uint64)
    ids = rng.permutation(n_blocks)[:33].astype(np.int64)
    slots = rng.permutation(n_slots)[:33].astype(np.int64)
    # the last job copies fewer blocks (another kind of entry in the same step)
    jobs = [(p, w, int(o), ids, slots) for p, w, o in zip(layers[:2], widths[:2], offsets[:2])]
    jobs.append((layers[2], widths[2], int(offsets[2]), ids[:5], slots[:5]))
    pool_before, layers_before = pool.copy(), [p.copy() for p in layers]
    for _ in range(20):  # helpers start late or early: every interleaving must give the same bytes
        tcopy.copy_pages(jobs, pool, total, to_pool, threads=threads)
    for p, w, o, i, s in jobs:
        rows, slot_parts = p.reshape(n_blocks, w), pool.reshape(n_slots, total)[:, o : o + w]
        assert (rows[i] == slot_parts[s]).all()
    if to_pool:  # untouched elsewhere
        mask = np.ones((n_slots, total), bool)
        for p, w, o, i, s in jobs:
            mask[s, o : o + w] = False
        assert (pool.reshape(n_slots, total)[mask] == pool_before.reshape(n_slots, total)[mask]).all()
    else:
        for p, before, (_, w, _, i, _) in zip(layers, layers_before, jobs):
            mask = np.ones(n_blocks, bool)
            mask[i] = False
            assert (p.reshape(n_blocks, w)[mask] == before.reshape(n_blocks, w)[mask]).all()
    pool_, avail = tcopy.helpers()
    if threads > 1 and avail > 1:
        assert pool_ is not None  # and every chunk ran on this thread or a helper
        assert seen <= {threading.get_ident()} | {t.ident for t in pool_._threads}


def test_copy_pages_raises_only_after_every_part_is_done(monkeypatch):
    monkeypatch.setattr(tcopy, "MIN_SPLIT_BYTES", 64)
    pages, pool = np.zeros(64 * 8, np.uint64), np.zeros(64 * 8, np.uint64)
    ids = np.arange(64, dtype=np.int64)
    bad = ids.copy()
    bad[-1] = 64  # out of range, in the last chunk (a helper's)
    with pytest.raises(IndexError):
        tcopy.copy_pages([(pages, 8, 0, bad, ids)], pool, 8, True, threads=2)
    tcopy.copy_pages([(pages, 8, 0, ids, ids)], pool, 8, True, threads=2)  # the pool still works


def _head(n: int, meta_bytes: int = 0) -> np.ndarray:
    return np.frombuffer(block_file._header(KEY, FP, n, meta_bytes), dtype=np.uint8)


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 4096 + 7, 8192 - 3, 8192, 3 * block_file._CHUNK + 13])
def test_mac_in_pieces_equals_the_reference(n):
    data = np.frombuffer(os.urandom(n), dtype=np.uint8)
    meta = np.frombuffer(os.urandom(n % 23), dtype=np.uint8)
    want = reference_mac(MK, _head(n, meta.size).tobytes(), data.tobytes(), meta.tobytes())
    assert mac.block_mac(MK, _head(n, meta.size), data, meta) == want
    for cuts in ({0, n // 64 * 8, n // 8 * 8}, {8, 8 * 1024, n // 8 * 8}):
        cuts = sorted(c for c in cuts | {0, n} if c <= n)
        acc, out = np.zeros(3, dtype=np.uint64), np.empty(n, np.uint8)
        for a, b in zip(cuts, cuts[1:]):  # in order, each piece copied out as it goes
            mac.mac_update(acc, MK, data[a:b], a, out[a:b])
        assert mac.mac_final(acc, MK, _head(n, meta.size), meta) == want and (out == data).all()


def test_mac_sees_bit_flips_moved_words_and_the_key():
    data = np.frombuffer(os.urandom(4 * 8192 + 5), dtype=np.uint8).copy()
    head, none = _head(data.size), np.zeros(0, np.uint8)
    base = mac.block_mac(MK, head, data, none)
    for i in range(0, len(data), 61):
        for bit in (0, 5):
            data[i] ^= 1 << bit
            assert mac.block_mac(MK, head, data, none) != base, (i, bit)
            data[i] ^= 1 << bit
    swapped = data.copy()
    swapped[:8192], swapped[8192:16384] = data[8192:16384], data[:8192]
    assert mac.block_mac(MK, head, swapped, none) != base
    words = data[:8 * 4096].view(np.uint64).copy()  # two words of one chunk swapped
    words[[3, 4]] = words[[4, 3]]
    assert mac.block_mac(MK, head, np.concatenate([words.view(np.uint8), data[8 * 4096:]]), none) != base
    assert mac.block_mac(MK, _head(data.size + 3), np.concatenate([data, np.zeros(3, np.uint8)]), none) != base
    assert mac.block_mac(mac.mac_key(bytes(16)), head, data, none) != base  # another secret
    assert mac.block_mac(MK, head, data, np.zeros(1, np.uint8)) != base  # the metadata counts


BIG = 3 * block_file._CHUNK + 13  # several read chunks and a short last one


@pytest.mark.parametrize("size", [0, 4096, BIG])
def test_write_block_matches_the_reference_encoding(tmp_path, size):
    payload = np.frombuffer(os.urandom(size), dtype=np.uint8)
    base = block_dir.block_dir(str(tmp_path), FP, 0)
    path = block_dir.block_path(base, KEY)
    block_file.write_block(path, KEY, FP, MK, payload, b"meta")  # also makes the missing directories
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    ours = open(path, "rb").read()
    write_reference(path, block_file.encode(KEY, FP, MK, payload, b"meta"))
    assert ours == open(path, "rb").read()
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp" in n]
    out = np.empty(size, dtype=np.uint8)
    assert block_file.read_into(path, KEY, FP, MK, out) == b"meta" and (out == payload).all()


def test_disk_corruption_anywhere_in_a_large_block_is_a_miss(tmp_path):
    payload = np.frombuffer(os.urandom(BIG), dtype=np.uint8)
    _, path = write(tmp_path, payload)
    good = open(path, "rb").read()
    start = block_file.HEADER_SIZE + len(b"meta")
    out = np.empty(BIG, dtype=np.uint8)
    # header fields, metadata, first chunk, a middle chunk, the chunk boundary, the short last chunk
    for pos in [0, 5, 8, 30, block_file.HEADER_SIZE - 1, block_file.HEADER_SIZE, start, start + block_file._CHUNK - 1,
                start + block_file._CHUNK, start + 2 * block_file._CHUNK + 100, len(good) - 1]:
        flipped = bytearray(good)
        flipped[pos] ^= 0x10
        open(path, "wb").write(flipped)
        assert block_file.read_into(path, KEY, FP, MK, out) is None, pos
    for data in (good[:-1], good[: start + block_file._CHUNK], good[:10], good + b"\0"):
        open(path, "wb").write(data)
        assert block_file.read_into(path, KEY, FP, MK, out) is None, len(data)
    open(path, "wb").write(good)
    assert block_file.read_into(path, KEY, FP, MK, out) == b"meta" and (out == payload).all()


def test_an_open_verified_block_changed_in_place_afterwards_is_not_read_as_data(tmp_path):
    """A byte flipped or the file cut short in place between open_verified and read_payload (by
    anyone: the soak's fault injector did it) must be a failed read, not KV."""
    payload = np.frombuffer(os.urandom(3 * 4096), dtype=np.uint8)
    _, path = write(tmp_path, payload)
    size = os.path.getsize(path)
    for pos in (0, 40, block_file.HEADER_SIZE, block_file.HEADER_SIZE + 4096 + 7, size - 1):  # header, payload, metadata
        write(tmp_path, payload)
        fd, _ = block_file.open_verified(path, KEY, FP, MK, payload.size)
        try:
            with open(path, "r+b") as f:
                f.seek(pos)
                b = f.read(1)
                f.seek(pos)
                f.write(bytes([b[0] ^ 0x01]))
            parts = [np.empty(4096, np.uint8), np.empty(2 * 4096, np.uint8)]
            assert not block_file.read_payload(fd, parts, MK), pos
        finally:
            os.close(fd)
    write(tmp_path, payload)
    fd, _ = block_file.open_verified(path, KEY, FP, MK, payload.size)
    try:
        os.truncate(path, size - 1)
        assert not block_file.read_payload(fd, [np.empty(payload.size, np.uint8)], MK)
        assert not block_file.read_payload(fd, [np.empty(payload.size - 8, np.uint8)], MK)  # not the payload's length
    finally:
        os.close(fd)


def test_an_open_verified_block_reads_the_same_bytes_after_unlink_or_replace(tmp_path):
    payload = np.frombuffer(os.urandom(3 * 4096), dtype=np.uint8)
    _, path = write(tmp_path, payload)
    fd, meta = block_file.open_verified(path, KEY, FP, MK, payload.size)
    try:
        assert meta == b"meta"
        os.unlink(path)  # evicted meanwhile (this engine never does it to an open entry; another may)
        write(tmp_path, np.zeros_like(payload))  # and rewritten by someone else
        parts = [np.empty(4096, np.uint8), np.empty(2 * 4096, np.uint8)]  # e.g. one view per layer
        assert block_file.read_payload(fd, parts, MK)
        assert (np.concatenate(parts) == payload).all()
        assert not block_file.read_payload(fd, [np.empty(payload.size + 4096, np.uint8)], MK)  # past the file: short
    finally:
        os.close(fd)
    open(path, "r+b").write(b"X")  # corrupt: no descriptor
    assert block_file.open_verified(path, KEY, FP, MK, payload.size) is None
