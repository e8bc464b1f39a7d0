"""A tier added through the contract alone (connector/base.py), inside vLLM's real Scheduler: a
fake tier defined here, appended to scheduler.SECONDARY_TIERS as a fourth tier after the disk and
remote tiers (a real redis-server), holding slot bytes in a dict its worker half (a hook on the real
WorkerSide's report) fills and reads. A second instance with fresh CPU tier, its disk files deleted
and the server emptied (same tier secret) finds the prompt in the fake tier only: looked up, fetched into CPU slots,
loaded into the KV cache (SimulatedWorker.check compares every loaded token with a recompute),
stored by the first instance, and each request released."""

import random
from typing import NamedTuple

from vllm_kvbm_plugin.connector import scheduler
from vllm_kvbm_plugin.connector.base import Verb
from vllm_kvbm_plugin.connector.metadata import Report
from vllm_kvbm_plugin.events.types import storage_tier
from vllm_kvbm_plugin.events.validator import Validator
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness

rng = random.Random(4)
PROMPT = [rng.randrange(10, 2000) for _ in range(200)]
BUILT_IN = list(scheduler.SECONDARY_TIERS)


class FakeOp(NamedTuple):
    tier: str
    verb: Verb


FETCH, WRITE = FakeOp("fake", Verb.FETCH), FakeOp("fake", Verb.WRITE)


class FakeTier:
    """A base.SecondaryTier over `store` (key -> slot bytes), shared like a remote store."""
    label, name, waits, direct = "fake", storage_tier("fake-tier"), False, False

    def __init__(self, store: dict):
        self.store = store
        self.jobs: list = []  # (op, key, slot) for the worker half
        self.fetching, self.writing = set(), set()
        self.looked_up, self.loaded, self.stored, self.finished = set(), set(), set(), set()

    def lookup(self, key) -> bool:
        self.looked_up.add(key)
        return key in self.store

    def prepare_lookup(self, req_id, keys) -> bool:
        return True

    def busy_loading(self, key) -> bool:
        return key in self.fetching

    def announcement(self, key):
        return None

    def submit_load(self, key, slot, meta) -> None:
        self.fetching.add(key)
        self.jobs.append((FETCH, key, slot))

    def submit_store(self, key, parent, end, announce, slot, meta) -> bool:
        if key in self.store or key in self.writing:
            return False
        self.writing.add(key)
        self.jobs.append((WRITE, key, slot))
        return True

    def settle(self, op, key, ok) -> None:
        assert ok
        if op.verb is Verb.FETCH:
            self.fetching.discard(key)
            self.loaded.add(key)
        else:
            self.writing.discard(key)
            self.stored.add(key)

    def hold(self, key, req_id) -> bool:
        return False

    def ready_direct(self, key) -> bool:
        return False

    def release(self, req_id) -> None:
        return

    def on_request_finished(self, req_id) -> None:
        self.finished.add(req_id)

    def on_schedule_end(self, meta) -> None:
        return

    def worker_failed(self) -> None:
        return

    def has_pending_work(self) -> bool:
        return bool(self.fetching or self.writing)

    def accounting(self) -> dict:
        return {"fake": {"fetching": len(self.fetching), "writing": len(self.writing)}}

    def take_events(self) -> list:
        return []


def instance(monkeypatch, store: dict, disk_path, url: str) -> tuple[SchedulerHarness, FakeTier]:
    made = []

    def create(layout, cfg):
        made.append(FakeTier(store))
        return made[-1]
    monkeypatch.setattr(scheduler, "SECONDARY_TIERS", [*BUILT_IN, create])  # one line: the new tier
    h = SchedulerHarness(HarnessConfig(hybrid=False, block_size=32, hash_block_size=None, num_blocks=64, connector={
        "cpu_bytes_to_use": 1 << 24, "disk_path": str(disk_path), "remote_url": url, "remote_events": "instance"}))
    fake = made[0]
    side = h.workers[0].side
    build = side.build_worker_meta

    def build_worker_meta():  # the fake tier's worker half: after this step's stores, as a writer thread would
        for op, key, slot in fake.jobs:
            if op is WRITE:
                store[key] = side.pool[slot].clone()
            else:
                side.pool[slot] = store[key]
            side.reports.append(Report(op, key, True))
        fake.jobs = []
        return build()
    side.build_worker_meta = build_worker_meta
    return h, fake


def test_a_fake_tier_is_looked_up_loaded_stored_and_released(tmp_path, monkeypatch, redis_server):
    store: dict = {}
    a, fake_a = instance(monkeypatch, store, tmp_path, redis_server.url)
    assert [t.label for t in a.connector.tiers] == ["cpu", "disk", "remote", "fake"]
    assert a.serve(PROMPT) == 0
    assert len(fake_a.stored) == len(store) == 6 and not fake_a.loaded  # written through from the CPU slots
    assert len(fake_a.finished) == 1

    a.settle()
    assert redis_server.client().dbsize() > 0  # the remote tier, before the fake one, stored them too
    for f in tmp_path.rglob("*.kvb"):  # the disk tier's blocks (its secret, hence the keys, stays)
        f.unlink()
    redis_server.client().flushall()
    b, fake_b = instance(monkeypatch, store, tmp_path, redis_server.url)  # fresh CPU tier, empty disk and remote
    rid = b.add(PROMPT, max_tokens=2)
    b.run(timeout=30)
    b.settle()
    assert b.cached_tokens[rid] == 192  # every KV token checked against a recompute on load
    assert fake_b.looked_up >= set(store) and fake_b.loaded == set(store)
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

