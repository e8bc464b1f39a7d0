"""The disk tier against whatever a directory may hold, and the modes of what it creates (issue 9
part 5, issue 14). Real files, FIFOs, sockets, symlinks and sparse files; each call that could hang
runs in a thread with a deadline."""

import errno
import logging
import os
import socket
import stat
import threading
import tracemalloc

import numpy as np
import pytest

from vllm_kvbm_plugin.testing.files import locked_writer, reference_mac, write_reference
from vllm_kvbm_plugin.tiers import block_dir, block_file
from vllm_kvbm_plugin.tiers.mac import mac_key

FP = bytes(range(16))
MK = mac_key(bytes(range(16, 32)))
SIZE = 4096
GOOD, OTHER = (0x1111111111111111, 0x2222222222222222), (0x3333333333333333, 0x4444444444444444)


def finishes(fn, *args, timeout: float = 10.0):
    """fn(*args) in a daemon thread; fails the test if it does not return within `timeout`."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} hung"
    if "error" in box:
        raise box["error"]
    return box["value"]


def key_of(i: int) -> tuple[int, int]:
    return (0xAB00000000000000 + i, i)  # every one in the "ab" prefix directory


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


def store(base, key, seed=0, meta=b"meta"):
    path = block_dir.block_path(str(base), key)
    block_file.write_block(path, key, FP, MK, payload(seed), meta)
    return path


def is_miss(path, key):
    """Every read of `path` as the block `key` is a miss, and none of them hangs."""
    out = np.zeros(SIZE, dtype=np.uint8)
    assert finishes(block_file.read_meta, path) is None
    assert finishes(block_file.open_verified, path, key, FP, MK, SIZE) is None
    assert finishes(block_file.read_into, path, key, FP, MK, out) is None
    return True


@pytest.fixture
def populated(tmp_path, monkeypatch):
    """A rank directory holding two valid blocks and one of each kind of foreign content named
    like block files (or not), plus a valid block outside it that symlinks point to."""
    base = tmp_path / "r0"
    store(base, GOOD, seed=1)
    store(base, OTHER, seed=2)
    elsewhere = tmp_path / "elsewhere"
    outside_key = key_of(99)
    outside = store(elsewhere, outside_key, seed=3)
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    ab = base / "ab"
    ab.mkdir()
    kinds = {}

    def named(kind, i):
        kinds[kind] = (ab / (block_dir.key_hex(key_of(i)) + block_dir.SUFFIX), key_of(i))
        return kinds[kind][0]

    os.mkfifo(named("fifo", 1))
    os.symlink(outside, named("symlink_to_block", 2))
    os.symlink(secret, named("symlink_to_passwd", 3))
    os.symlink(tmp_path / "nowhere", named("dangling_symlink", 4))
    named("directory", 5).mkdir()
    with open(named("sparse_4g", 6), "wb") as f:
        f.truncate(4 << 30)  # no real disk use
    monkeypatch.chdir(ab)  # a socket path must be short
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(named("socket", 7).name)
    try:
        os.mknod(named("char_device", 8), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except (PermissionError, OSError):
        del kinds["char_device"]
    # a valid block of another format version (and one claiming a future one)
    old = named("version_1", 9)
    store(base, key_of(9), seed=9)
    data = bytearray(old.read_bytes())
    data[4:6] = (1).to_bytes(2, "little")
    old.write_bytes(bytes(data))
    # a valid block file copied under another key's name
    named("wrong_key", 10).write_bytes(open(block_dir.block_path(str(base), GOOD), "rb").read())
    # a header that claims huge metadata, with a file size to match: never read
    huge = named("huge_meta", 11)
    with open(huge, "wb") as f:
        f.write(block_file._HEADER.pack(block_file.MAGIC, block_file.VERSION, 0, block_file.key_bytes(key_of(11)), FP, 0,
                                  1 << 31, 0, 0))
        f.truncate(block_file.HEADER_SIZE + (1 << 31))
    foreign = [ab / "README", ab / (block_dir.key_hex(key_of(12)).upper() + block_dir.SUFFIX),
               ab / ("0x" + block_dir.key_hex(key_of(13))[2:] + block_dir.SUFFIX), ab / "notes.tmp",
               base / "cd" / (block_dir.key_hex(key_of(14)) + block_dir.SUFFIX),  # the wrong prefix directory
               base / "zz", base / (block_dir.key_hex(key_of(15)) + block_dir.SUFFIX)]  # not in a prefix directory
    (base / "cd").mkdir()
    for p in foreign:
        p.write_bytes(b"not ours")
    os.symlink(elsewhere / "ab", base / "ef")  # a prefix directory that is a symlink
    os.mkfifo(base / "12")  # ... a FIFO
    yield base, kinds, foreign, outside, secret
    sock.close()


def test_scan_lists_only_regular_block_files_and_never_hangs(populated):
    base, kinds, foreign, outside, secret = populated
    found = dict(finishes(block_dir.scan, str(base)))
    regular = {k for kind, (p, k) in kinds.items() if p.is_file() and not p.is_symlink()}
    assert set(found) == {GOOD, OTHER} | regular
    assert {kind for kind, (_, k) in kinds.items() if k in regular} == {
        "sparse_4g", "version_1", "wrong_key", "huge_meta"}  # ours by name: the scheduler reads and drops them
    assert found[kinds["sparse_4g"][1]] == 4 << 30
    # nothing is followed, nothing foreign removed, targets untouched
    for p, _ in kinds.values():
        assert os.path.lexists(p)
    for p in foreign:
        assert p.read_bytes() == b"not ours"
    assert secret.read_text().startswith("root:") and os.path.isfile(outside)
    assert os.path.islink(base / "ef") and stat.S_ISFIFO(os.lstat(base / "12").st_mode)


def test_every_read_of_foreign_content_is_a_miss(populated):
    base, kinds, foreign, outside, _ = populated
    for kind, (path, key) in kinds.items():
        assert is_miss(str(path), key), kind
    for p in foreign:
        assert finishes(block_file.read_meta, str(p)) is None
    # a huge or sparse file is rejected by its size, nothing close to it is allocated
    tracemalloc.start()
    for kind in ("sparse_4g", "huge_meta"):
        path, key = kinds[kind]
        block_file.read_into(str(path), key, FP, MK, np.zeros(SIZE, dtype=np.uint8))
        block_file.read_meta(str(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, peak
    # the untouched entries are still whole
    for key, seed in ((GOOD, 1), (OTHER, 2)):
        path = block_dir.block_path(str(base), key)
        out = np.zeros(SIZE, dtype=np.uint8)
        assert block_file.read_meta(path) == b"meta"
        assert block_file.read_into(path, key, FP, MK, out) == b"meta" and (out == payload(seed)).all()
        fd, meta = block_file.open_verified(path, key, FP, MK, SIZE)
        os.close(fd)
    assert block_file.read_meta(outside) == b"meta"  # the symlinks' target itself is fine


def test_writes_never_go_through_symlinks_or_onto_foreign_entries(tmp_path):
    base = tmp_path / "r0"
    store(base, GOOD)
    target = tmp_path / "target"
    target.write_text("keep")
    (base / "ab").mkdir()
    # a block name taken by a symlink: the link itself is replaced, its target untouched
    link = block_dir.block_path(str(base), key_of(1))
    os.symlink(target, link)
    store(base, key_of(1), seed=5)
    assert not os.path.islink(link) and target.read_text() == "keep"
    assert block_file.read_into(link, key_of(1), FP, MK, np.zeros(SIZE, np.uint8)) == b"meta"
    # ... by a FIFO: replaced, no hang
    fifo = block_dir.block_path(str(base), key_of(2))
    os.mkfifo(fifo)
    finishes(store, base, key_of(2))
    assert os.path.isfile(fifo)
    # ... by a directory: refused for this block only, the directory and its content stay
    d = block_dir.block_path(str(base), key_of(3))
    os.makedirs(os.path.join(d, "inside"))
    with pytest.raises(block_file.BlockRefused):
        store(base, key_of(3))
    assert os.path.isdir(os.path.join(d, "inside"))
    # a prefix directory that is a symlink (or a file) is never written through
    os.makedirs(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", base / "cd")
    (base / "ef").write_bytes(b"x")
    for key in ((0xCD << 56, 1), (0xEF << 56, 1)):
        with pytest.raises(block_file.BlockRefused):
            store(base, key)
    assert os.listdir(tmp_path / "elsewhere") == [] and (base / "ef").read_bytes() == b"x"
    # no temporary file is ever left behind, and the tier keeps working
    assert not [n for _, _, names in os.walk(base) for n in names if ".tmp" in n]
    store(base, key_of(4))
    assert set(dict(block_dir.scan(str(base)))) == {GOOD, key_of(1), key_of(2), key_of(4)}
    with pytest.raises(block_file.BlockRefused):
        block_file.write_block(block_dir.block_path(str(base), key_of(5)), key_of(5), FP, MK, payload(0), b"m" * (block_file.MAX_META + 1))


def test_temporary_files_of_live_writers_stay_and_abandoned_ones_go(tmp_path):
    base = tmp_path / "r0"
    path = store(base, GOOD)
    d = os.path.dirname(path)
    crashed = path + ".tmp123"  # an older version's name, nobody holds it
    abandoned = path + f".tmp{os.getpid()}.0badc0de"
    for p in (crashed, abandoned):
        open(p, "wb").write(b"partial")
    foreign_tmp = os.path.join(d, "mine.tmp")
    open(foreign_tmp, "wb").write(b"x")
    fifo_tmp = path + ".tmp7"
    os.mkfifo(fifo_tmp)
    # a writer in another process holds its temporary file
    live = block_dir.block_path(str(base), OTHER) + ".tmp999999.cafe"
    os.mkdir(os.path.dirname(live))
    writer = locked_writer(live, 60)
    try:
        assert finishes(block_dir.scan, str(base)) == [(GOOD, os.path.getsize(path))]
        assert os.path.exists(live), "a live writer's temporary file stays"
        assert not os.path.exists(crashed) and not os.path.exists(abandoned)
        assert os.path.exists(foreign_tmp) and stat.S_ISFIFO(os.lstat(fifo_tmp).st_mode)
    finally:
        writer.kill()
        writer.wait()
    block_dir.scan(str(base))
    assert not os.path.exists(live), "once its writer is gone it is a leftover"


# ---- modes (issue 14) --------------------------------------------------------------------------
def modes_below(root):
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


@pytest.fixture
def umask():
    old = os.umask(0)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask", [0, 0o022, 0o277], ids=["umask-0", "umask-022", "umask-277"])
def test_everything_the_tier_creates_is_private_whatever_the_umask(tmp_path, umask, mask):
    umask(mask)
    root = tmp_path / "kv"  # a disk_path that does not exist yet
    base = block_dir.block_dir(str(root), FP, 0)
    block_dir.prepare_block_dir(str(root), base)
    for k in (GOOD, OTHER, key_of(1)):
        store(base, k)
    write_reference(block_dir.block_path(base, key_of(2)), block_file.encode(key_of(2), FP, MK, payload(0)))
    umask(0o022)
    modes = modes_below(tmp_path)
    assert modes.pop("kv") == 0o700
    dirs = {p: m for p, m in modes.items() if os.path.isdir(tmp_path / p)}
    files = {p: m for p, m in modes.items() if p not in dirs}
    assert len(dirs) == 2 + 3 and set(dirs.values()) == {0o700}, dirs  # layout, r0, ab, 11, 33
    assert len(files) == 4 and set(files.values()) == {0o600}, files


def test_existing_directories_are_tightened_but_not_disk_path_nor_others(tmp_path, umask):
    umask(0o022)
    root = tmp_path / "kv"
    base = block_dir.block_dir(str(root), FP, 0)
    store(base, GOOD)
    store(base, OTHER)
    for p in (root, os.path.dirname(base), base, os.path.join(base, "11"), os.path.join(base, "33")):
        os.chmod(p, 0o755)  # as an older version left them
    os.chmod(os.path.join(base, "33"), 0o2775)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.kvbm.disk")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        block_dir.prepare_block_dir(str(root), base)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o755, "the user's disk_path is theirs"
    for p in (os.path.dirname(base), base, os.path.join(base, "11"), os.path.join(base, "33")):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p
    text = " ".join(r.getMessage() for r in records)
    assert "now 700" in text and "2 key-prefix directories" in text, text
    assert block_file.read_meta(block_dir.block_path(base, GOOD)) == b"meta"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_directories_of_other_users_are_left_alone(tmp_path, umask):
    umask(0o022)
    root = tmp_path / "kv"
    base = block_dir.block_dir(str(root), FP, 0)
    store(base, GOOD)
    prefix = os.path.join(base, "11")
    os.chmod(prefix, 0o755)
    os.chown(prefix, 4242, 4242)
    block_dir.prepare_block_dir(str(root), base)
    st = os.stat(prefix)
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o755, 4242)


def test_symlinks_in_the_chain_are_refused_and_not_followed(tmp_path, umask):
    umask(0o022)
    root = tmp_path / "kv"
    root.mkdir()
    victim = tmp_path / "victim"
    (victim / "r0").mkdir(parents=True)
    os.chmod(victim / "r0", 0o755)
    os.symlink(victim, root / FP.hex())
    base = block_dir.block_dir(str(root), FP, 0)
    with pytest.raises(OSError, match="not a directory"):
        block_dir.prepare_block_dir(str(root), base)
    assert stat.S_IMODE(os.stat(victim / "r0").st_mode) == 0o755
    assert block_dir.scan(base) == []  # nor read through
    os.unlink(root / FP.hex())
    os.mkfifo(root / FP.hex())
    with pytest.raises(OSError, match="not a directory"):
        finishes(block_dir.prepare_block_dir, str(root), base)
    with pytest.raises(ValueError):
        block_dir.make_private_dir(str(root), str(tmp_path))
    # a disk_path that is itself a symlink is the user's choice: used as it is
    real = tmp_path / "real"
    real.mkdir()
    os.chmod(real, 0o755)
    os.symlink(real, tmp_path / "link")
    base = block_dir.block_dir(str(tmp_path / "link"), FP, 0)
    block_dir.prepare_block_dir(str(tmp_path / "link"), base)
    store(base, GOOD)
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(real / FP.hex()).st_mode) == 0o700


# ---- O_DIRECT writes (issue 10) ----------------------------------------------------------------
# sizes around the direct-write buffer: one piece, a piece boundary, several pieces and a short last
DIRECT_SIZES = [block_file._DIRECT_MIN, block_file._DIRECT_CHUNK - block_file.HEADER_SIZE, block_file._DIRECT_CHUNK + 13,
                3 * block_file._DIRECT_CHUNK + 4032]


@pytest.mark.parametrize("size", DIRECT_SIZES)
@pytest.mark.parametrize("meta", [b"", b"m" * 5000], ids=["no-meta", "meta"])
def test_direct_writes_are_the_same_exact_private_file(tmp_path, size, meta):
    data = np.frombuffer(os.urandom(size), dtype=np.uint8)
    base = block_dir.block_dir(str(tmp_path), FP, 0)
    path = block_dir.block_path(base, GOOD)
    block_file.write_block(path, GOOD, FP, MK, data, meta, direct=True)
    assert base not in block_file._no_direct  # ext4 / tmpfs take O_DIRECT: this was a direct write
    ours = open(path, "rb").read()
    assert len(ours) == block_file.HEADER_SIZE + size + len(meta)  # the page padding was cut off
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp" in n]
    out = np.empty(size, dtype=np.uint8)
    assert block_file.read_into(path, GOOD, FP, MK, out) == meta and (out == data).all()
    write_reference(path, block_file.encode(GOOD, FP, MK, data, meta))  # the reference encoding
    assert ours == open(path, "rb").read()
    with open(path, "r+b") as f:  # and the MAC still covers every payload byte
        f.seek(block_file.HEADER_SIZE + size - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 0x80]))
    assert block_file.read_into(path, GOOD, FP, MK, out) is None


def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path, monkeypatch, caplog):
    """The kernel's own EINVAL: offsets and lengths of 8 bytes are no O_DIRECT alignment ext4 or
    tmpfs take. The block is stored all the same, and later writes under that root go buffered."""
    monkeypatch.setattr(block_file, "_DIRECT_ALIGN", 8)
    monkeypatch.setattr(block_file, "_no_direct", set())
    base = block_dir.block_dir(str(tmp_path), FP, 0)
    data = np.frombuffer(os.urandom(block_file._DIRECT_MIN + 8), dtype=np.uint8)
    with caplog.at_level(logging.INFO, logger="vllm.kvbm.disk"):
        for k in (GOOD, OTHER):
            block_file.write_block(block_dir.block_path(base, k), k, FP, MK, data, b"meta", direct=True)
    assert block_file._no_direct == {base}
    assert sum("O_DIRECT refused" in r.getMessage() for r in caplog.records) == 1  # said once
    for k in (GOOD, OTHER):
        path = block_dir.block_path(base, k)
        assert os.path.getsize(path) == block_file.HEADER_SIZE + data.nbytes + 4
        out = np.empty(data.nbytes, dtype=np.uint8)
        assert block_file.read_into(path, k, FP, MK, out) == b"meta" and (out == data).all()
    assert not [n for n in os.listdir(os.path.dirname(block_dir.block_path(base, GOOD))) if ".tmp" in n]


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_batched_writes_hold_their_temporary_files_while_engines_scan(tmp_path, direct):
    """write_blocks flocks each temporary file until it is renamed: an engine scanning the
    directory meanwhile (which removes temporary files nobody holds) never takes a live one, so
    every block of every batch lands."""
    base = str(tmp_path / "b")
    data = np.frombuffer(os.urandom(block_file._DIRECT_MIN), dtype=np.uint8)
    done = threading.Event()

    def scanning():
        while not done.is_set():
            block_dir.scan(base)

    block_file.write_block(block_dir.block_path(base, key_of(0)), key_of(0), FP, MK, data, b"m")  # the directories
    scanner = threading.Thread(target=scanning, daemon=True)
    scanner.start()
    try:
        keys = [key_of(i) for i in range(1, 301)]
        for part in range(0, len(keys), 30):
            batch = keys[part: part + 30]
            errors = block_file.write_blocks([block_dir.block_path(base, k) for k in batch], batch, FP, MK,
                                       [data] * len(batch), [b"m"] * len(batch), direct=direct)
            assert errors == [None] * len(batch)
    finally:
        done.set()
        scanner.join()
    assert base not in block_file._no_direct
    out = np.empty(data.nbytes, dtype=np.uint8)
    assert block_file.read_blocks([block_dir.block_path(base, k) for k in keys], keys, FP, MK, [out] * len(keys)) == [b"m"] * 300
    assert not [n for _, _, names in os.walk(base) for n in names if ".tmp" in n]


# ---- one batch, many files: each file on its own (issue 10) ----------------------------------------
def reference_read(path: str, key, plen: int):
    """An independent reader of the format: (payload, metadata) or None, with Python's own file
    objects, struct and the reference MAC (how the format is defined, not how the tier reads it)."""
    data = open(path, "rb").read()
    h = block_file.parse_header(data)
    if (h is None or h.key != block_file.key_bytes(key) or h.fingerprint != FP or h.payload_bytes != plen
            or len(data) != block_file.HEADER_SIZE + plen + h.meta_bytes):
        return None
    body = np.frombuffer(data, dtype=np.uint8, offset=block_file.HEADER_SIZE, count=plen)
    meta = data[block_file.HEADER_SIZE + plen:]
    return (body, meta) if reference_mac(MK, data[:block_file.HEADER_SIZE], body.tobytes(), meta) == h.mac else None


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_the_format_is_the_same_both_ways(tmp_path, direct):
    """Files of the Python reference encoding read with the batched reader, and files of the
    batched writer read by an independent reader, byte for byte, for sizes around every buffer."""
    base = str(tmp_path)
    sizes = [0, 8, 13, block_file._CHUNK - 1, block_file._CHUNK, block_file._CHUNK + 5, block_file._DIRECT_MIN, 3 * block_file._DIRECT_CHUNK + 4032]
    keys = [key_of(i) for i in range(len(sizes))]
    datas = [np.frombuffer(os.urandom(n), dtype=np.uint8) for n in sizes]
    metas = [b"", b"m" * 5000, b"x", b"", b"meta", b"y" * 7, b"", b"z" * 4093]
    paths = [block_dir.block_path(base, k) for k in keys]
    assert block_file.write_blocks(paths, keys, FP, MK, datas, metas, direct=direct) == [None] * len(keys)
    for path, key, data, meta in zip(paths, keys, datas, metas):
        body, m = reference_read(path, key, data.nbytes)
        assert (body == data).all() and m == meta
        ours = open(path, "rb").read()
        write_reference(path, block_file.encode(key, FP, MK, data, meta))  # the Python reference encoding
        assert open(path, "rb").read() == ours
    outs = [np.empty(n, dtype=np.uint8) for n in sizes]
    assert block_file.read_blocks(paths, keys, FP, MK, outs) == metas
    assert all((o == d).all() for o, d in zip(outs, datas))


def test_a_batch_reads_each_file_on_its_own(tmp_path):
    """Good files between missing, foreign, corrupt, truncated, FIFO, symlink and sparse ones:
    each bad one a miss (None), each good one its bytes; nothing hangs, nothing raises."""
    base = tmp_path / "r0"
    good = [store(base, key_of(i), seed=i) for i in range(0, 16, 2)]
    bad = {}
    for i in range(1, 16, 2):
        bad[i] = block_dir.block_path(str(base), key_of(i))
    store(base, key_of(1), seed=1)
    with open(bad[1], "r+b") as f:  # a flipped sign bit in the payload
        f.seek(block_file.HEADER_SIZE + 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x80]))
    store(base, key_of(3), seed=3)
    os.truncate(bad[3], os.path.getsize(bad[3]) - 1)
    os.mkfifo(bad[5])
    os.symlink(good[0], bad[7])
    with open(bad[9], "wb") as f:
        f.truncate(4 << 30)
    open(bad[11], "wb").write(open(good[1], "rb").read())  # another key's file under this name
    store(base, key_of(13), seed=13, meta=b"m")
    # 15: missing
    keys = [key_of(i) for i in range(16)]
    outs = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
    metas = finishes(block_file.read_blocks, [block_dir.block_path(str(base), k) for k in keys], keys, FP, MK, outs)
    for i in range(16):
        if i % 2 == 0:
            assert metas[i] == b"meta" and (outs[i] == payload(i)).all(), i
        elif i == 13:
            assert metas[i] == b"m"
        else:
            assert metas[i] is None, i
    opened = finishes(block_file.open_verified_blocks, [block_dir.block_path(str(base), k) for k in keys], keys, FP, MK, SIZE)
    try:
        assert [o is not None for o in opened] == [i % 2 == 0 or i == 13 for i in range(16)]
        for i in range(0, 16, 2):  # each kept open on its verified file
            out = np.zeros(SIZE, dtype=np.uint8)
            assert opened[i][1] == b"meta" and block_file.read_payload(opened[i][0], [out], MK) and (out == payload(i)).all()
    finally:
        for o in opened:
            if o is not None:
                os.close(o[0])
    assert block_file.read_blocks([], [], FP, MK, []) == []
    assert block_file.read_blocks([good[0]], [key_of(0)], bytes(15), MK, [outs[0]]) == [None]  # another fingerprint


def test_a_batch_writes_each_file_on_its_own(tmp_path):
    """A refused block (its name a directory, its directory a symlink, metadata too large) fails
    alone; the others of the batch are stored; the missing directories are made 0700."""
    base = tmp_path / "r0"
    os.makedirs(os.path.join(block_dir.block_path(str(base), key_of(1)), "inside"))
    os.makedirs(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", base / "cd")
    keys = [key_of(0), key_of(1), (0xCD << 56, 1), key_of(3), (0x12 << 56, 4)]
    metas = [b"a", b"b", b"c", b"m" * (block_file.MAX_META + 1), b"e"]
    errors = block_file.write_blocks([block_dir.block_path(str(base), k) for k in keys], keys, FP, MK,
                               [payload(i) for i in range(5)], metas)
    assert errors[0] is None and errors[4] is None
    assert all(isinstance(e, block_file.BlockRefused) for e in errors[1:4]), errors
    assert os.listdir(tmp_path / "elsewhere") == []
    assert stat.S_IMODE(os.stat(base / "12").st_mode) == 0o700
    out = np.empty(SIZE, dtype=np.uint8)
    assert block_file.read_into(block_dir.block_path(str(base), keys[4]), keys[4], FP, MK, out) == b"e" and (out == payload(4)).all()
    # a failure that is no refusal is an OSError for the block: a file system that takes no new
    # file (read-only, or here a path through a regular file, which root cannot write through either)
    (base / "ff").write_bytes(b"x")
    e = block_file.write_blocks([os.path.join(str(base), "ff", "x", "y.kvb")], [key_of(6)], FP, MK, [payload(6)], [b""])[0]
    assert isinstance(e, OSError) and not isinstance(e, block_file.BlockRefused) and e.errno == errno.ENOTDIR, e
