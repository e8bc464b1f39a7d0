"""The shared remote tier (Redis / Valkey) with a real redis-server: two scheduler sides ("instances",
each inside vLLM's real Scheduler with real WorkerSides and a KV-checking stand-in forward) share
one server. Whatever B loads is checked against what a recompute writes (SimulatedWorker.check);
a failing server (killed, restarted, paused) or a bad value is a miss, never an error."""

import random
import threading
import time

import pytest

from vllm_kvbm_plugin.events.types import LOCALITY_REMOTE, MEDIUM_STORAGE, BlockStored
from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binary
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness

pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
pytestmark = pytest.mark.skipif(server_binary() is None,
                                reason="no redis-server on PATH: scripts/setup.sh installs Debian's as root")

rng = random.Random(1)


def prompt(n: int = 200) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


@pytest.fixture
def server():
    s = RedisServer().start()
    yield s
    s.stop()


def instance(url: str, hybrid: bool = False, **connector) -> SchedulerHarness:
    geometry = dict(block_size=160, hash_block_size=32) if hybrid else dict(block_size=32, hash_block_size=None)
    return SchedulerHarness(HarnessConfig(hybrid=hybrid, num_blocks=64, connector={
        "cpu_bytes_to_use": 1 << 24, "remote_url": url, **connector}, **geometry))


def serve(h: SchedulerHarness, tokens: list[int], max_tokens: int = 2) -> int:
    """One request to completion (every step checks the KV it finds); the tokens it started with."""
    rid = h.add(tokens, max_tokens=max_tokens)
    deadline = time.monotonic() + 30
    while h.scheduler.has_unfinished_requests():
        h.step()
        assert time.monotonic() < deadline, "request did not finish"
    h.settle()
    return h.cached_tokens[rid]


def idle(h: SchedulerHarness) -> bool:
    acc = h.connector.accounting()
    return (acc["remote"] == {"fetching": 0, "writing": 0} and acc["reports_pending"] == 0
            and acc["cpu"]["busy"] == 0)


@pytest.mark.parametrize("hybrid, hit", [(False, 192), (True, 192)])
def test_instance_b_hits_what_instance_a_stored(server, hybrid, hit):
    a, b = instance(server.url, hybrid), instance(server.url, hybrid)
    p = prompt()
    assert serve(a, p) == 0
    assert server.client().dbsize() > 0
    assert serve(b, p) == hit  # B never computed it: loaded from the server, KV checked
    assert b.connector.remote.counters["fetched"] > 0
    assert idle(a) and idle(b)
    remote = [ev for batch in a.batches for ev in batch.events
              if isinstance(ev, BlockStored) and ev.medium == MEDIUM_STORAGE]
    assert remote and all(ev.locality == LOCALITY_REMOTE and ev.ownership == a.connector.remote.name.ownership
                          for ev in remote)
