"""tiers/roofline.py on real memory, a real directory and a real redis-server: figures for every
transfer kind, and nothing left behind (KV bytes restored, file removed, keys deleted)."""

import os
import stat

import torch

from vllm_kvbm_plugin.tiers import roofline


def test_copy_peaks_restore_the_kv_bytes():
    kv = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    before = kv.clone()
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    peaks = roofline.copy_peaks(kv, pool)
    assert peaks["copy_to_pool"] > 0 and peaks["copy_from_pool"] > 0
    assert torch.equal(kv, before) and torch.equal(pool, before)


def test_disk_peaks_leave_nothing_and_never_follow_a_link(tmp_path):
    d = tmp_path / "tier"
    d.mkdir(mode=0o700)
    (d / "other").symlink_to(tmp_path / "elsewhere")
    peaks = roofline.disk_peaks(str(d), nbytes=8 << 20, chunk=1 << 20)
    assert peaks["disk_write"] > 0 and peaks["disk_read"] > 0
    assert sorted(os.listdir(d)) == ["other"] and not (tmp_path / "elsewhere").exists()


def test_per_direction_maps_every_measured_kind():
    peaks = {"copy_to_pool": 1.0, "copy_from_pool": 2.0, "disk_write": 3.0, "disk_read": 4.0}
    assert roofline.per_direction(peaks) == {"cpu_store": 1.0, "cpu_load": 2.0, "disk_write": 3.0,
                                             "disk_read": 4.0, "disk_load": 4.0}


def test_remote_peaks_delete_their_keys(redis_server):
    client = redis_server.client()
    client.set(b"kvbm:unrelated", b"x")
    peaks = roofline.remote_peaks(client, value_bytes=64 << 10, count=8)
    assert peaks["remote_write"] > 0 and peaks["remote_read"] > 0
    assert sorted(client.scan_iter(match="*")) == [b"kvbm:unrelated"]


def test_the_disk_file_is_private(tmp_path, monkeypatch):
    seen = []
    real_open = os.open

    def spy(path, flags, mode=0o777, **kw):
        fd = real_open(path, flags, mode, **kw)
        seen.append((flags, stat.S_IMODE(os.fstat(fd).st_mode)))
        return fd

    monkeypatch.setattr(os, "open", spy)
    roofline.disk_peaks(str(tmp_path), nbytes=1 << 20, chunk=1 << 20, reps=1)
    (flags, mode), = seen
    assert mode == 0o600 and flags & os.O_EXCL and flags & os.O_NOFOLLOW
