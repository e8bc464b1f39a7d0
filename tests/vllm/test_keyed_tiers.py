"""Keyed block keys in the connector (issue 11, item 4), on vLLM's real Scheduler with real workers
and a real disk tier: the tier directory is named by the keyed root, the secret is kept at the root
of disk_path, the directory key spec 1 wrote for the same layout is removed at startup, and another
secret shares nothing (misses, never wrong hits)."""

import os
import random
import stat

import pytest

from vllm_kvbm_plugin.connector import layout as layout_mod
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness
from vllm_kvbm_plugin.tiers import secret

rng = random.Random(3)


def prompt(n: int = 200) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def instance(disk_path: str) -> SchedulerHarness:
    return SchedulerHarness(HarnessConfig(hybrid=False, num_blocks=64, block_size=32, hash_block_size=None,
                                          connector={"cpu_bytes_to_use": 1 << 24, "disk_path": disk_path}))


def test_tier_directory_is_keyed_and_spec_1_leftovers_are_removed(tmp_path):
    disk = tmp_path / "kv"
    a = instance(str(disk))
    p = prompt()
    assert a.serve(p) == 0
    lay = a.connector.layout
    assert lay.tier_dir == str(disk / f"{lay.root[0]:016x}{lay.root[1]:016x}") and os.path.isdir(lay.rank_dir(0))
    key_file = disk / secret.FILE_NAME
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert lay.root == lay.keyer.root(*layout_mod._root_fields(a.vllm_config, a.scheduler.kv_cache_config,
                                                               lay.hash_unit))
    # what spec 1 left for this layout: its directory, named by the unkeyed root, with a block file
    v1 = layout_mod.v1_key_root(a.vllm_config, a.scheduler.kv_cache_config, lay.hash_unit)
    v1_dir = disk / f"{v1[0]:016x}{v1[1]:016x}"
    assert str(v1_dir) != lay.tier_dir
    (v1_dir / "r0" / "ab").mkdir(parents=True)
    (v1_dir / "r0" / "ab" / ("ab" * 16 + ".kvb")).write_bytes(b"KVBM" + bytes(100))

    b = instance(str(disk))  # a restart on the same disk_path
    assert not v1_dir.exists()  # removed at startup
    assert b.connector.layout.tier_dir == lay.tier_dir  # same secret (kept in disk_path), same directory
    assert b.serve(p) == 192  # from the disk tier: its CPU tier starts empty


def test_another_secret_shares_nothing(tmp_path, monkeypatch):
    disk = str(tmp_path / "kv")
    p = prompt()
    monkeypatch.setenv(secret.ENV, "11" * 16)
    a = instance(disk)
    assert a.serve(p) == 0
    monkeypatch.setenv(secret.ENV, "22" * 16)
    b = instance(disk)
    assert b.connector.layout.tier_dir != a.connector.layout.tier_dir
    assert b.serve(p) == 0  # a miss, although a's entries are on the same disk
    monkeypatch.setenv(secret.ENV, "11" * 16)
    assert instance(disk).serve(p) == 192  # the same secret finds them
    assert not os.path.exists(os.path.join(disk, secret.FILE_NAME))  # the environment's secret is not stored


def test_a_malformed_environment_secret_stops_startup(tmp_path, monkeypatch):
    monkeypatch.setenv(secret.ENV, "not-a-secret")
    with pytest.raises(ValueError, match="KVBM_KEY_SECRET.*32 hex characters"):
        instance(str(tmp_path / "kv"))


def test_a_server_unreachable_at_startup_leaves_the_remote_tier_off(tmp_path, caplog):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    h = SchedulerHarness(HarnessConfig(hybrid=False, num_blocks=64, block_size=32, hash_block_size=None, workers=2,
                                       connector={"cpu_bytes_to_use": 1 << 24, "remote_url": url,
                                                  "disk_path": str(tmp_path / "kv")}))
    assert h.connector.layout.remote_off and h.connector.tier("remote") is None
    assert all(w.side.tier("remote") is None for w in h.workers)  # the workers agree: no remote I/O at all
    assert "remote tier is off for this process" in caplog.text
    p = prompt()
    assert h.serve(p) == 0
    h.reset_prefix_cache()
    assert h.serve(p) == 192  # the local tiers serve as usual (secret from disk_path)
