"""Remote tier events once per tier on real engines: two engine processes (tiny Llama) share a real
redis-server, `vllm-kvbm announce` (in-process, real ZMQ sockets) publishes the tier's events, the
server evicts (maxmemory, allkeys-lru) and deletes. The three recorded streams, merged, validate with
0 errors, each remote entry's BlockStored comes once, and it is the event of the GPU block it copies
(same hash, parent, tokens), so a router can join them."""

import collections

import pytest

from vllm_kvbm_plugin.events.types import LOCALITY_REMOTE, MEDIUM_GPU, BlockRemoved, BlockStored
from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binary
from vllm_kvbm_plugin.tiers.block_file import VERSION

from .helpers import batches, outputs
from .test_tiers_engine import HIT, PROMPT, spec

VALUES = f"kvbm:{VERSION}:*"  # the names of our values in this format
pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    server_binary() is None, reason="no redis-server on PATH: scripts/setup.sh installs Debian's as root")]


def test_two_engines_the_announcer_and_server_evictions(run_engine):
    from tests.vllm.test_remote_announcer import Announcer, held_in, stored, validate

    server = RedisServer().start()
    try:
        ann = Announcer(server.url)
        other = PROMPT[:64] + [11] * 136  # shares 2 blocks with PROMPT
        a = run_engine(spec([{"prompts": [PROMPT]}], events=True, cpu_bytes_to_use=4 << 20, remote_url=server.url))
        b = run_engine(spec([{"prompts": [PROMPT]}, {"prompts": [other]}], events=True,
                            cpu_bytes_to_use=4 << 20, remote_url=server.url))
        assert outputs(b)[0]["num_cached_tokens"] in (0, HIT)  # a hit, or (late lookup) the same keys again
        names = sorted(server.client().scan_iter(match=VALUES))
        assert len(names) == 10  # PROMPT's 6 blocks, and the 4 of `other` past the shared 2
        ann.wait(lambda evs: len(stored(evs)) == 10, timeout=60)
        streams = lambda: ([bt for _, bt in batches(a)], [bt for _, bt in batches(b)],  # noqa: E731
                           [bt for _, bt in ann.records])
        # each entry announced once, by the announcer only, as the GPU block it copies
        remote = [ev for ev in ann.events() if isinstance(ev, BlockStored)]
        assert set(collections.Counter((ev.group_idx, ev.block_hashes[0]) for ev in remote).values()) == {1}
        assert all(ev.locality == LOCALITY_REMOTE for ev in remote)
        gpu = {ev.block_hashes[i]: (ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1],
                                    ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
               for s in streams()[:2] for bt in s for ev in bt.events
               if isinstance(ev, BlockStored) and ev.medium == MEDIUM_GPU for i in range(len(ev.block_hashes))}
        assert all(gpu[ev.block_hashes[0]] == (ev.parent_block_hash, ev.token_ids) for ev in remote)
        for s in streams()[:2]:
            assert not any(getattr(ev, "locality", None) == LOCALITY_REMOTE for bt in s for ev in bt.events)
        assert len(validate(*streams()).held("STORAGE", locality=LOCALITY_REMOTE)) == 10

        # the server evicts (allkeys-lru, maxmemory below what it holds) and a client deletes
        c = server.client()
        c.delete(names[0])
        c.config_set("maxmemory", int(c.info("memory")["used_memory"]) - 3 * len(c.get(names[1])))
        c.set("kvbm-test-write", b"x")  # any write makes the server evict down to maxmemory
        assert int(c.info("stats")["evicted_keys"]) > 0
        left = {k.split(b":")[-1] for k in c.scan_iter(match=VALUES)}
        ann.wait(lambda evs: held_in(evs) == len(left), timeout=30)
        assert sum(isinstance(ev, BlockRemoved) for ev in ann.events()) == 10 - len(left)
        v = validate(*streams())
        assert len(v.held("STORAGE", locality=LOCALITY_REMOTE)) == len(left)
        ann.close()
    finally:
        server.stop()
