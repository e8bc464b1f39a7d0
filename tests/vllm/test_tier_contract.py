"""A tier added through the contracts alone (connector/base.py), inside vLLM's real Scheduler: the
fake tier of testing/fake_tier.py (both halves in one module), named in `tier_module_paths` as a
fourth tier after the disk and remote tiers (a real redis-server), its entries plain files that its
worker half reads and writes. A second instance with a fresh CPU tier, its disk files deleted and the
server's values deleted (same tier secret) finds the prompt in the fake tier only: looked up, fetched
into CPU slots, loaded into the KV cache (SimulatedWorker.check compares every loaded token with a
recompute), stored by the first instance, and each request released."""

import random

import pytest

from vllm_kvbm_plugin.events.validator import Validator
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness

rng = random.Random(4)
PROMPT = [rng.randrange(10, 2000) for _ in range(200)]
FAKE = "vllm_kvbm_plugin.testing.fake_tier"


def instance(disk_path, url: str, workers: int = 1) -> SchedulerHarness:
    return SchedulerHarness(HarnessConfig(hybrid=False, block_size=32, hash_block_size=None, num_blocks=64,
                                          workers=workers, connector={
        "cpu_bytes_to_use": 1 << 24, "disk_path": str(disk_path), "remote_url": url, "remote_events": "instance",
        "tier_module_paths": [FAKE]}))  # one line: the new tier


@pytest.mark.parametrize("workers", [1, 2])
def test_a_fake_tier_is_looked_up_loaded_stored_and_released(tmp_path, redis_server, workers):
    a = instance(tmp_path, redis_server.url, workers)
    fake_a = a.connector.tier("fake")
    assert [t.label for t in a.connector.tiers] == ["cpu", "disk", "remote", "fake"]
    assert a.serve(PROMPT) == 0
    # the workers opened their halves at the first step (the scheduler side's decision)
    assert all([t.label for t in w.side.tiers] == ["disk", "remote", "fake"] for w in a.workers)
    a.settle()
    files = sorted(p.name for p in (tmp_path / "fake-tier").iterdir())
    assert len(fake_a.stored) == 6 and len(files) == 6 * workers and not fake_a.loaded  # written through
    assert len(fake_a.finished) == 1
    c = redis_server.client()
    values = [n for n in c.scan_iter(match="kvbm:*") if b"key-secret" not in n]
    assert values  # the remote tier, before the fake one, stored them too
    for f in tmp_path.rglob("*.kvb"):  # the disk tier's blocks (its secret, hence the keys, stays)
        f.unlink()
    c.delete(*values)
    b = instance(tmp_path, redis_server.url, workers)  # fresh CPU tier, empty disk and remote
    fake_b = b.connector.tier("fake")
    rid = b.add(PROMPT, max_tokens=2)
    b.run(timeout=30)
    b.settle()
    assert b.cached_tokens[rid] == 192  # every KV token checked against a recompute on load
    assert fake_b.looked_up >= fake_a.stored and fake_b.loaded == fake_a.stored
    assert b.connector.tier("remote").counters["fetched"] == 0  # looked up there first, missed
    assert fake_b.finished == {rid}
    acc = b.connector.accounting()
    assert acc["fake"] == {"fetching": 0, "writing": 0} and acc["cpu"]["busy"] == 0 and acc["reports_pending"] == 0
    assert not b.connector.has_pending_push_work()
    assert len(b.connector.tier("disk")) == 6  # the fetched entries went on to the disk tier, not back to the fake one
    for h in (a, b):
        v = Validator()
        for batch in h.batches:
            v.apply(batch)
        assert v.errors == 0

