"""KVBMRemoteTier as a secondary tier of vLLM's own TieringOffloadingManager (in-process, 0.32 and
0.33) on a real Redis / Valkey server: stores cascade from vLLM's CPU primary tier to the server,
hits are promoted back through it; missing, damaged, truncated or foreign values are misses, never
bytes; a server that is down is a miss, never an exception."""

import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import Medium

from vllm_kvbm_plugin.testing import offloading_drive
from vllm_kvbm_plugin.testing.offloading_drive import chunk_key, payload
from vllm_kvbm_plugin.testing.redis_server import server_binary
from vllm_kvbm_plugin.tiers import block_file

pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
pytestmark = pytest.mark.skipif(server_binary() is None,
                                reason="no redis-server on PATH: scripts/setup.sh installs Debian's as root")


def Tiered(url) -> offloading_drive.Tiered:
    """vLLM's tiering manager with our remote tier on `url`, and the calls the connector makes."""
    return offloading_drive.Tiered({"type": "KVBMRemoteTier", "module_path": "vllm_kvbm_plugin.offloading", "url": url})


def keys_of(name, n):
    return [chunk_key(f"{name}{i}") for i in range(n)]


def test_a_second_manager_hits_what_the_first_stored(tiered, server):
    keys = keys_of("a", 5)
    a = tiered(server.url)
    a.store(keys)
    assert a.storage_events(removed=False) == keys  # announced once each, once the server has them
    ev = next(e for e in a.events if e.medium is Medium.STORAGE)
    assert ev.locality.value == "REMOTE" and ev.ownership == a.tier.ownership
    assert sorted(server.client().keys("kvbm:*")) == sorted(a.tier.name(k).encode() for k in keys)
    b = tiered(server.url)  # another instance: an empty CPU tier, the same server
    served = b.load(keys)
    for k in keys:
        assert served[k] is not None and np.array_equal(served[k], payload(k))


@pytest.mark.parametrize("fault", ["flip", "truncate", "foreign", "delete", "wrongtype"])
def test_bad_values_are_misses_never_bytes(tiered, server, fault):
    keys = keys_of("c", 4)
    t = tiered(server.url)
    t.store(keys)
    c, name = server.client(), t.tier.name(keys[2])
    v = c.get(name)
    if fault == "flip":
        c.setrange(name, block_file.HEADER_SIZE + 7, bytes([v[block_file.HEADER_SIZE + 7] ^ 0x40]))
    elif fault == "truncate":
        c.set(name, v[:-1])
    elif fault == "foreign":  # another layout's fingerprint
        c.set(name, v[:24] + bytes(16) + v[40:])
    elif fault == "delete":
        c.delete(name)
    else:
        c.delete(name)
        c.rpush(name, b"not ours")
    served = t.load(keys)
    for k in keys[:2]:
        assert np.array_equal(served[k], payload(k))
    assert served[keys[2]] is None
    if fault != "delete":  # found by the lookup, failed at the load: forgotten, announced, deleted
        assert t.tier.failed_loads >= 1 and keys[2] in t.storage_events(removed=True)
        assert c.exists(name) == 0
    assert t.load(keys)[keys[2]] is None  # a plain miss now


def test_a_server_down_is_a_miss_and_hits_resume(tiered, server):
    keys = keys_of("d", 3)
    t = tiered(server.url)
    t.store(keys)
    server.stop()
    assert all(v is None for v in t.load(keys).values())
    t.store(keys_of("e", 2))  # writes fail as misses, no exception
    assert t.tier.failed_writes >= 2
    server.start()
    server.client().flushall()
    time.sleep(1.2)  # the breakers' first backoff (0.5 s) and a probe
    t.store(keys)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.client().dbsize() < len(keys):
        t.settle()
        t.store(keys)
    served = t.load(keys)
    assert all(np.array_equal(served[k], payload(k)) for k in keys)


def test_a_bad_value_another_instance_wrote_is_deleted_and_its_removal_announced_here(tiered, server):
    """Its Stored event is in the writer's stream; the remote tier is one index for every stream a
    router merges, so the instance that deletes it announces the removal (else the router would
    hold it for good, and a later write of it would be a duplicate store). A value found in the
    store is neither written nor announced again."""
    keys = keys_of("f", 2)
    a = tiered(server.url)
    a.store(keys)
    c, name = server.client(), a.tier.name(keys[1])
    at = block_file.HEADER_SIZE + 3
    c.setrange(name, at, bytes([c.get(name)[at] ^ 0x40]))
    b = tiered(server.url)
    served = b.load(keys)
    assert np.array_equal(served[keys[0]], payload(keys[0])) and served[keys[1]] is None
    assert b.tier.failed_loads == 1 and b.storage_events(removed=True) == [keys[1]] and c.exists(name) == 0
    b.store(keys)  # keys[1] is new (keys[0] is in b's CPU tier since its load)
    assert b.storage_events(removed=False) == [keys[1]]
    sets = c.info("commandstats")["cmdstat_set"]["calls"]
    d = tiered(server.url)  # a third instance: both values are on the server, neither is sent again
    d.store(keys)
    assert d.storage_events(removed=False) == [] and c.info("commandstats")["cmdstat_set"]["calls"] == sets


def test_a_chunk_back_in_the_cpu_tier_is_not_sent_again_while_the_server_holds_it(tiered, server):
    """Issue 31: vLLM cascades a chunk to the secondary tiers each time it re-enters the CPU tier;
    one this instance wrote is asked for (EXISTS) and written only if the server lost it."""
    keys = keys_of("g", 4)
    t = tiered(server.url)  # 8 CPU chunks
    c = server.client()
    before = c.info("commandstats").get("cmdstat_set", {}).get("calls", 0)  # the tier secret's SET NX

    def sets() -> int:
        return c.info("commandstats").get("cmdstat_set", {}).get("calls", 0) - before

    t.store(keys)
    assert sets() == 4
    for _ in range(2):
        t.store(keys_of("h", 8))  # evicts keys from the CPU tier
        t.store(keys)  # back in the CPU tier: cascaded again
    assert sets() == 4 + 8  # the 8 others once, keys once
    assert t.storage_events(removed=False) == keys + keys_of("h", 8)  # each announced once
    c.flushall()  # the server lost everything (as a restart does)
    t.store(keys_of("h", 8))  # h0-h3 re-enter the CPU tier (h4-h7 never left it)
    t.store(keys)
    assert sets() == 12 + 8 and c.dbsize() == 8  # what re-entered is written again
    served = tiered(server.url).load(keys)
    assert all(np.array_equal(served[k], payload(k)) for k in keys)
