"""The tier secret (tiers/secret.py) from each source, on real files and a real redis-server, and the
removal of the tier directory key spec 1 wrote (connector/layout.remove_v1_tier_dir)."""

import fcntl
import os
import stat
import subprocess
import sys
import threading

import pytest

from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.layout import remove_v1_tier_dir
from vllm_kvbm_plugin.hashing import spec
from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binary
from vllm_kvbm_plugin.tiers import secret

HEX = "00112233445566778899aabbccddeeff"


def test_the_environment_wins_and_a_malformed_value_names_the_format(monkeypatch, tmp_path):
    s = secret.load("redis://127.0.0.1:1/0", str(tmp_path), env={secret.ENV: HEX.upper()})
    assert (s.key, s.source, s.remote_off) == (bytes.fromhex(HEX), "env", False)
    assert not os.listdir(tmp_path)  # neither the disk nor the server was asked
    for bad in ("abc", HEX + "0", "g" * 32, HEX[:-1] + " x"):
        with pytest.raises(ValueError, match="32 hex characters") as e:
            secret.load(None, None, env={secret.ENV: bad})
        assert bad not in str(e.value)  # a secret is never echoed
    monkeypatch.setenv(secret.ENV, "not-hex")
    with pytest.raises(ValueError, match="KVBM_KEY_SECRET.*32 hex characters"):
        KVBMConfig.from_extra({})  # fails when the config is read, before the engine starts
    assert HEX not in repr(secret.load(None, None, env={secret.ENV: HEX}))


def test_without_a_shared_tier_each_process_draws_its_own():
    a, b = secret.load(None, None, env={}), secret.load(None, None, env={})
    assert a.source == b.source == "process" and len(a.key) == 16 and a.key != b.key
    # once per process: the scheduler and a worker in one process agree
    assert secret.tier_secret(None, None) is secret.tier_secret(None, None)


def test_disk_secret_is_written_once_private_and_read_back(tmp_path):
    root = tmp_path / "kv"
    got = []
    threads = [threading.Thread(target=lambda: got.append(secret.load(None, str(root), env={}).key)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # a process of its own agrees too
    out = subprocess.run([sys.executable, "-c", "import sys; from vllm_kvbm_plugin.tiers import secret; "
                          "print(secret.load(None, sys.argv[1], env={}).key.hex())", str(root)],
                         capture_output=True, text=True, check=True).stdout.strip()
    path = root / secret.FILE_NAME
    assert len(set(got)) == 1 and got[0].hex() == out == path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_size == 33
    assert sorted(os.listdir(root)) == [secret.FILE_NAME]  # no temporary file left


def test_an_unusable_disk_path_falls_back_to_a_process_secret(tmp_path, caplog):
    (tmp_path / "file").write_text("x")
    s = secret.load(None, str(tmp_path / "file" / "kv"), env={})  # the engine keeps serving, disk tier off
    assert s.source == "process" and len(s.key) == 16 and "cannot keep the block-key secret" in caplog.text


@pytest.mark.parametrize("damage", ["short", "long", "not-hex", "symlink", "directory", "fifo"])
def test_a_malformed_disk_secret_is_a_startup_error_and_stays(tmp_path, damage):
    path = tmp_path / secret.FILE_NAME
    outside = tmp_path / "elsewhere"
    outside.write_text(HEX + "\n")
    if damage == "short":
        path.write_text(HEX[:20] + "\n")
        os.utime(path, (1, 1))  # not being written right now
    elif damage == "long":
        path.write_text(HEX + HEX + "\n")
    elif damage == "not-hex":
        path.write_text("z" * 32 + "\n")
    elif damage == "symlink":
        path.symlink_to(outside)  # a valid secret, but not followed
    elif damage == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    before = os.lstat(path)
    with pytest.raises(ValueError, match=secret.FILE_NAME):
        secret.load(None, str(tmp_path), env={})
    after = os.lstat(path)
    assert (after.st_ino, after.st_mtime_ns, after.st_mode) == (before.st_ino, before.st_mtime_ns, before.st_mode)


needs_redis = pytest.mark.skipif(server_binary() is None, reason="no redis-server or valkey-server "
                                 "(scripts/setup.sh installs Debian's)")


@needs_redis
def test_remote_secret_is_set_once_and_shared(tmp_path):
    server = RedisServer(maxmemory="16mb").start()
    try:
        a = secret.load(server.url, str(tmp_path), env={})
        b = secret.load(server.url, None, env={})
        assert a.source == b.source == "remote" and a.key == b.key and not a.remote_off
        assert server.client().get(secret.REMOTE_NAME).decode() == a.key.hex()
        assert secret.on_disk(str(tmp_path)) == a.key  # kept beside the disk tier too
        # an entry written by another instance first is the one used
        server.client().set(secret.REMOTE_NAME, HEX)
        assert secret.load(server.url, None, env={}).key == bytes.fromhex(HEX)
        server.client().set(secret.REMOTE_NAME, "garbage")
        with pytest.raises(ValueError, match="kvbm-key-secret"):
            secret.load(server.url, None, env={})
    finally:
        server.stop()


@needs_redis
def test_a_server_restarted_empty_gets_the_secret_back_from_the_disk_tier(tmp_path, caplog):
    """The soak killed redis-server (restarted empty) and then the engine, before any running
    instance wrote the secret back: the restarted engine drew a new one, and its disk tier moved to
    a new tier directory, the old one left behind (twice disk_bytes_to_use on disk). The disk tier's
    file now offers its secret to the empty store."""
    server = RedisServer(maxmemory="16mb").start()
    try:
        first = secret.load(server.url, str(tmp_path), env={})
        server.client().flushall()  # restarted empty
        again = secret.load(server.url, str(tmp_path), env={})
        assert again.source == "remote" and again.key == first.key
        assert server.client().get(secret.REMOTE_NAME).decode() == first.key.hex()
        assert secret.load(server.url, None, env={}).key == first.key  # an instance without a disk tier
        # the store holds another secret (another instance came first): it wins, the file follows it
        server.client().set(secret.REMOTE_NAME, HEX)
        assert secret.load(server.url, str(tmp_path), env={}).key == bytes.fromhex(HEX)
        assert secret.on_disk(str(tmp_path)) == bytes.fromhex(HEX) and "unreachable" in caplog.text
        assert stat.S_IMODE(os.stat(tmp_path / secret.FILE_NAME).st_mode) == 0o600
        assert sorted(os.listdir(tmp_path)) == [secret.FILE_NAME]  # no temporary file left
    finally:
        server.stop()


def test_an_unreachable_server_turns_the_remote_tier_off_for_this_process(tmp_path, caplog):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    s = secret.load(url, str(tmp_path), env={})
    assert s.remote_off and s.source == "disk" and s.key == bytes.fromhex((tmp_path / secret.FILE_NAME).read_text())
    assert secret.load(url, None, env={}).source == "process"
    assert "remote tier is off for this process" in caplog.text


# ---- spec 1's tier directory ----------------------------------------------------------------------
V1_ROOT = spec.v1_root_key("tiny-llama", "bfloat16", "LBHNC", 32, 0, 1)
V1_NAME = f"{V1_ROOT[0]:016x}{V1_ROOT[1]:016x}"


def _v1_tree(disk_path, ranks=2, files=3):
    top = disk_path / V1_NAME
    for r in range(ranks):
        for i in range(files):
            key = f"{i:02x}" + "ab" * 15
            d = top / f"r{r}" / key[:2]
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{key}.kvb").write_bytes(b"KVBM" + bytes(60))
    return top


def test_spec_1_directory_of_this_layout_is_removed(tmp_path):
    top = _v1_tree(tmp_path)
    (top / "r0" / "00" / f"00{'ab' * 15}.kvb.tmp123.beef").write_bytes(b"x")  # a crash's leftover
    other = tmp_path / ("c" * 32) / "r0"  # another layout's directory (or spec 2's): not touched
    other.mkdir(parents=True)
    (tmp_path / secret.FILE_NAME).write_text(HEX + "\n")
    assert remove_v1_tier_dir(str(tmp_path), V1_ROOT) == 7
    assert sorted(os.listdir(tmp_path)) == sorted(["c" * 32, secret.FILE_NAME]) and other.is_dir()
    assert remove_v1_tier_dir(str(tmp_path), V1_ROOT) == 0  # nothing left to do


@pytest.mark.parametrize("foreign", ["symlink-file", "symlink-dir", "other-name", "fifo", "top-file",
                                     "wrong-prefix", "being-written", "top-symlink"])
def test_spec_1_directory_with_anything_not_ours_is_left_whole(tmp_path, foreign):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    disk = tmp_path / "kv"
    disk.mkdir()
    top = _v1_tree(disk)
    leaf = top / "r1" / "01"
    lock = None
    if foreign == "symlink-file":
        (leaf / f"02{'ab' * 15}.kvb").symlink_to(outside / "precious")
    elif foreign == "symlink-dir":
        (top / "r1" / "ff").symlink_to(outside)
    elif foreign == "other-name":
        (leaf / "notes.txt").write_text("mine")
    elif foreign == "fifo":
        os.mkfifo(leaf / f"01{'cd' * 15}.kvb")
    elif foreign == "top-file":
        (top / "README").write_text("mine")
    elif foreign == "wrong-prefix":
        (leaf / f"ff{'ab' * 15}.kvb").write_bytes(b"x")
    elif foreign == "being-written":
        tmp = leaf / f"01{'ab' * 15}.kvb.tmp99.cafe"
        lock = open(tmp, "wb")
        fcntl.flock(lock, fcntl.LOCK_EX)  # a live writer of the old version
    else:
        for p in sorted(top.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        top.rmdir()
        top.symlink_to(outside)
    listing = sorted(str(p) for p in disk.rglob("*"))
    try:
        assert remove_v1_tier_dir(str(disk), V1_ROOT) == 0
    finally:
        if lock is not None:
            lock.close()
    assert sorted(str(p) for p in disk.rglob("*")) == listing
    assert (outside / "precious").read_text() == "keep"
