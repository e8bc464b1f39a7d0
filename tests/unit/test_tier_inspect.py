"""`vllm-kvbm tiers inspect` on block files written by the disk tier's writer (with a corrupt one, a
stale temporary file, and foreign content named like ours: symlinks, a FIFO) and on values in a real
redis-server: counts, layouts, ages, verification, and nothing changed or followed."""

import json
import os
import time

import numpy as np
import pytest

from vllm_kvbm_plugin import cli
from vllm_kvbm_plugin.tiers import block_dir, block_file, inspector, remote_value
from vllm_kvbm_plugin.tiers.mac import mac_key
from vllm_kvbm_plugin.tiers.secret import ENV as SECRET_ENV

FP_A, FP_B = bytes(range(16)), bytes(range(16, 32))
SECRET = bytes(range(32, 48))
MK = mac_key(SECRET)
SIZE = 4096
DAY = 86400


def payload(i):
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


def write(root, fp, rank, i, meta=b""):
    key = (i << 8, i)
    path = block_dir.block_path(block_dir.block_dir(str(root), fp, rank), key)
    block_file.write_block(path, key, fp, MK, payload(i), meta or block_file.encode_meta(32, [b"event %d" % (i % 10)]))
    return path, key


def flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 4]))


@pytest.fixture(autouse=True)
def tier_secret(monkeypatch):
    """Verifying checks MACs: the tier secret, as an operator gives it."""
    monkeypatch.setenv(SECRET_ENV, SECRET.hex())


def tree(root):
    """Every entry below `root` (links not followed) with its type, size, mode and mtime."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(d, n))
            out[os.path.join(d, n)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def disk_tier(tmp_path):
    root = tmp_path / "kv"
    a = [write(root, FP_A, 0, i) for i in range(6)]
    b = [write(root, FP_B, rank, 10 + i) for rank in (0, 1) for i in range(2)]
    now = time.time()
    os.utime(a[0][0], (now - 2 * DAY, now - 2 * DAY))  # <7d
    os.utime(a[1][0], (now - 30 * DAY, now - 30 * DAY))  # >=7d
    with open(a[2][0], "r+b") as f:  # a flipped payload byte: the MAC fails
        f.seek(block_file.HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(block_file.HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    prefix_dir = os.path.dirname(a[3][0])
    elsewhere = write(tmp_path / "elsewhere", FP_A, 0, 40)[0]
    os.symlink(elsewhere, os.path.join(prefix_dir, block_dir.key_hex((40 << 8, 40)) + block_dir.SUFFIX))
    os.mkfifo(os.path.join(os.path.dirname(a[4][0]), block_dir.key_hex((4 << 8, 99)) + block_dir.SUFFIX))  # never opened
    stale = a[5][0] + ".tmp1.abcd"  # a crash's leftover: tidying would remove it, a look must not
    with open(stale, "wb") as f:
        f.write(b"partial")
    os.utime(stale, (now - DAY, now - DAY))
    os.symlink(tmp_path / "elsewhere" / FP_A.hex(), root / ("ff" * 16))  # a layout directory's name: not followed
    (root / "kvbm-key-secret").write_bytes(b"0" * 32)  # the tier secret: ours, not counted
    return root


def test_disk_report(disk_tier):
    before = tree(disk_tier)
    r = inspector.inspect(str(disk_tier), verify=True)
    assert tree(disk_tier) == before, "the inspection changed the directory"
    assert r["kind"] == "disk" and r["entries"] == 10
    size = os.path.getsize(block_dir.block_path(block_dir.block_dir(str(disk_tier), FP_A, 0), (1 << 8, 1)))
    assert r["bytes"] == 10 * size
    assert r["layouts"] == {FP_A.hex(): {"entries": 6, "bytes": 6 * size, "ranks": [0],
                                         "fingerprints": {"0": FP_A.hex()}},
                            FP_B.hex(): {"entries": 4, "bytes": 4 * size, "ranks": [0, 1],
                                         "fingerprints": {"0": FP_B.hex(), "1": FP_B.hex()}}}
    assert r["age"]["histogram"] == {"<1m": 8, "<1h": 0, "<1d": 0, "<7d": 1, ">=7d": 1}
    assert r["age"]["basis"] == "written" and 30 * DAY - 60 < r["age"]["oldest_s"] < 30 * DAY + 60
    # the symlink and the FIFO named like block files, the stale temporary file (listed, not
    # counted), the symlinked layout directory
    assert r["skipped"] == 3, r
    assert r["verify"] == {"checked": 10, "failed": 1, "other_fingerprint": 0}
    plain = inspector.inspect(str(disk_tier))
    assert plain["verify"] is None and "fingerprints" not in plain["layouts"][FP_A.hex()]


def test_files_whose_fingerprint_is_not_the_directory_name(tmp_path, capsys):
    """KVBMConnector's files: the directory is named by the layout root, each header holds the
    tensor fingerprint (root and the KV cache tensors' shapes). Healthy: 0 failed; a flipped
    payload byte or a file of another fingerprint among them: failed."""
    root, tensors = tmp_path / "kv", bytes(range(100, 116))
    paths = []
    for i in range(5):
        key = (i << 8, i)
        paths.append(block_dir.block_path(block_dir.block_dir(str(root), FP_A, 0), key))
        block_file.write_block(paths[-1], key, tensors, MK, payload(i), block_file.encode_meta(32, [b"e"]))
    r = inspector.inspect(str(root), verify=True)
    assert r["verify"] == {"checked": 5, "failed": 0, "other_fingerprint": 0}
    assert r["layouts"][FP_A.hex()]["fingerprints"] == {"0": tensors.hex()}
    assert cli.main(["tiers", "inspect", str(root), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verified 5: 0 failed" in out and f"rank 0: fingerprint {tensors.hex()} (KVBMConnector's" in out
    flip(paths[2], block_file.HEADER_SIZE + 9)  # a flipped payload byte
    assert inspector.inspect(str(root), verify=True)["verify"] == {"checked": 5, "failed": 1, "other_fingerprint": 0}
    assert cli.main(["tiers", "inspect", str(root), "--verify"]) == 1
    capsys.readouterr()
    key = (9 << 8, 9)  # intact, but of another layout than its rank's other files: a load misses it
    block_file.write_block(block_dir.block_path(block_dir.block_dir(str(root), FP_A, 0), key), key, FP_B, MK, payload(9), b"m")
    r = inspector.inspect(str(root), verify=True)
    assert r["verify"] == {"checked": 6, "failed": 2, "other_fingerprint": 1}
    assert r["layouts"][FP_A.hex()]["fingerprints"] == {"0": tensors.hex()}  # most files carry it
    assert "(1 of another fingerprint than their rank's)" in inspector.summary(r)
    # more damaged files of the rank's fingerprint than intact ones: damaged files still name it
    for p in paths[3:]:
        flip(p, block_file.HEADER_SIZE + 9)
    key = (10 << 8, 10)
    block_file.write_block(block_dir.block_path(block_dir.block_dir(str(root), FP_A, 0), key), key, FP_B, MK, payload(10), b"m")
    r = inspector.inspect(str(root), verify=True)
    assert r["verify"] == {"checked": 7, "failed": 5, "other_fingerprint": 2}
    assert r["layouts"][FP_A.hex()]["fingerprints"] == {"0": tensors.hex()}


def test_cli_json_and_summary(disk_tier, capsys):
    assert cli.main(["tiers", "inspect", str(disk_tier), "--json"]) == 0  # without --verify: no failure known
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["entries"] == 10 and err == ""  # no progress line when stderr is not a TTY
    assert cli.main(["tiers", "inspect", str(disk_tier), "--verify"]) == 1  # a corrupt entry
    out = capsys.readouterr().out
    assert "10 entries" in out and f"layout {FP_B.hex()} (ranks 0,1): 4 entries" in out and "1 failed" in out


def test_a_symlinked_or_missing_disk_path_is_an_error(tmp_path, capsys):
    os.symlink(tmp_path, tmp_path / "link")
    assert cli.main(["tiers", "inspect", str(tmp_path / "link")]) == 2
    assert cli.main(["tiers", "inspect", str(tmp_path / "missing")]) == 2
    assert "symlink is not followed" in capsys.readouterr().err


def test_remote_report(server):  # redis-server and valkey-server (tests/conftest.py)
    pytest.importorskip("redis")
    c = server.client()
    for fp, rank, n in ((FP_A, 0, 5), (FP_B, 1, 3)):
        for i in range(n):
            key = (i << 8, i)
            name = remote_value.value_name(fp.hex().encode(), rank, block_dir.key_hex(key).encode())
            value = bytearray(b"".join(bytes(p) for p in remote_value.value_parts(key, fp, MK, payload(i), b"m")))
            if fp == FP_A and i == 0:
                value[block_file.HEADER_SIZE + 5] ^= 0xFF  # damaged
            c.set(name, bytes(value))
    c.hset(remote_value.value_name(FP_A.hex().encode(), 0, b"ab" * 16), "x", 1)  # not a value: skipped
    c.set("kvbm:announcer:marker", b"1")  # ours, not a value: skipped
    c.set("someone-else", b"x")  # not under kvbm: not looked at
    snapshot = {k: c.dump(k) for k in c.keys("*")}
    r = inspector.inspect(server.url, verify=True)
    assert {k: c.dump(k) for k in c.keys("*")} == snapshot, "the inspection changed the server"
    size = block_file.HEADER_SIZE + SIZE + 1
    assert r["kind"] == "remote" and r["entries"] == 8 and r["bytes"] == 8 * size
    assert r["layouts"] == {FP_A.hex(): {"entries": 5, "bytes": 5 * size, "ranks": [0],
                                         "fingerprints": {"0": FP_A.hex()}},
                            FP_B.hex(): {"entries": 3, "bytes": 3 * size, "ranks": [1],
                                         "fingerprints": {"1": FP_B.hex()}}}
    assert r["age"]["basis"] == "idle" and r["age"]["histogram"]["<1m"] == 8
    assert r["skipped"] == 2 and r["verify"] == {"checked": 8, "failed": 1, "other_fingerprint": 0}
    # KVBMConnector's values: named by the layout root, each header holding the tensor fingerprint
    tensors = bytes(range(100, 116))
    for i in range(3):
        key = (i << 8, i)
        c.set(remote_value.value_name(FP_B.hex().encode(), 2, block_dir.key_hex(key).encode()),
              b"".join(bytes(p) for p in remote_value.value_parts(key, tensors, MK, payload(i), b"m")))
    r = inspector.inspect(server.url, verify=True)
    assert r["verify"] == {"checked": 11, "failed": 1, "other_fingerprint": 0}
    assert r["layouts"][FP_B.hex()]["fingerprints"] == {"1": FP_B.hex(), "2": tensors.hex()}
