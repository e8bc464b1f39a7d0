"""The remote tier on a real three-node Redis Cluster (`redis+cluster://seed,seed,...`): entries are
spread over the nodes by the cluster client, two instances (vLLM's real Scheduler, real WorkerSides,
KV checked every step) share them, tensor-parallel ranks' keys of one entry live on different nodes,
and a node that dies is a miss until it is back."""

import random
import threading
import time

import pytest

from vllm_kvbm_plugin.testing.redis_server import RedisClusterServers, server_binary
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness
from vllm_kvbm_plugin.tiers.resp import CLIENT_NAME, check_url, cluster_seeds

pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
needs_server = pytest.mark.skipif(server_binary() is None,
                                  reason="no redis-server on PATH: scripts/setup.sh installs Debian's as root")

rng = random.Random(7)


def prompt(n: int = 200) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster():
    c = RedisClusterServers().start()
    yield c
    c.stop()


def instance(url: str, workers: int = 1) -> SchedulerHarness:
    return SchedulerHarness(HarnessConfig(block_size=32, num_blocks=64, workers=workers, connector={
        "cpu_bytes_to_use": 1 << 24, "remote_url": url, "remote_events": "instance"}))


def test_cluster_urls_are_checked_at_startup():
    assert cluster_seeds("redis+cluster://u:pw@10.0.0.1:7000,[::1]:7001") == (
        [("10.0.0.1", 7000), ("::1", 7001)], "u", "pw")
    for bad in ("redis+cluster://10.0.0.1", "redis+cluster://h:port", "memcached://h:1", 7):
        with pytest.raises(ValueError, match="remote_url"):
            check_url(bad)


@needs_server
@pytest.mark.parametrize("workers", [1, 2])
def test_instance_b_hits_what_a_stored_across_the_cluster(cluster, workers):
    a, b = instance(cluster.url, workers), instance(cluster.url, workers)
    p = prompt()
    assert a.serve(p) == 0
    for _ in range(2):  # more values: keys depend on the tier secret, new with each test cluster, and
        a.serve(prompt())  # 7 values all land on one node of three 0.14% of the time (seen once); 21: 3e-10
    per_node = [sum(1 for _ in s.client().scan_iter(match="kvbm:*")) for s in cluster.nodes]  # block values
    assert sum(n > 0 for n in per_node) >= 2, per_node  # the client spread the entries
    assert b.serve(p) == 192  # B's first request: loaded from the cluster, every block's KV checked
    assert b.connector.tier("remote").counters["fetched"] > 0


def ours(node) -> set:
    """Our connections to `node` (their ids)."""
    return {c["id"] for c in node.client().client_list() if c["name"] == CLIENT_NAME}


@needs_server
@pytest.mark.parametrize("workers", [1, 2])
def test_a_fresh_instance_is_connected_to_every_node_before_its_first_request(cluster, workers):
    """The scheduler side connects at startup (its lookups); every worker once it learns the
    scheduler side's decision, in the engine's first step, before any fetch can be sent (a
    request's first step only starts its lookup)."""
    before = [ours(s) for s in cluster.nodes]
    b = instance(cluster.url, workers)

    def new() -> list[int]:
        return [len(ours(s) - old) for s, old in zip(cluster.nodes, before)]

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 10  # connections are made behind startup / the step
        while min(new()) < n and time.monotonic() < deadline:
            time.sleep(0.02)

    wait_for(1)
    assert new() == [1] * len(cluster.nodes)  # the scheduler side alone: workers never decide
    b.step()  # the engine's first step: the decision reaches the workers
    wait_for(1 + workers)
    assert new() == [1 + workers] * len(cluster.nodes)
    assert b.connector.tier("remote").counters["lookups"] == 0


@needs_server
def test_a_node_down_is_a_miss_and_hits_resume_when_it_is_back(cluster):
    errors, hook = [], threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        a, b = instance(cluster.url), instance(cluster.url)
        p = prompt()
        assert a.serve(p) == 0
        cluster.nodes[0].kill()
        assert b.serve(p) < 192  # some entries lived on the dead node: computed, KV checked
        cluster.nodes[0].start()  # empty, rejoins from its nodes file
        cluster.wait_ok()
        deadline = time.monotonic() + 20
        hit = 0
        while hit < 192 and time.monotonic() < deadline:  # the breakers' backoffs end, both probe
            time.sleep(a.connector.tier("remote").breaker.MIN_BACKOFF + 0.1)
            q = prompt()
            assert a.serve(q) == 0
            time.sleep(b.connector.tier("remote").breaker.MIN_BACKOFF + 0.1)
            hit = b.serve(q)
        assert hit == 192  # without restarting either instance
        assert not errors
    finally:
        threading.excepthook = hook
