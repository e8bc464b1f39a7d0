"""Our Subscriber against vLLM's real ZmqEventPublisher (PUB + replay ROUTER on ipc sockets)."""

import json
import threading
import time

import pytest
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from vllm_kvbm_plugin import cli
from vllm_kvbm_plugin.events import recording
from vllm_kvbm_plugin.events.subscriber import Subscriber


def batch(i):
    return KVEventBatch(ts=float(i), events=[BlockStored(
        block_hashes=[i], parent_block_hash=None, token_ids=[i] * 4, block_size=4,
        lora_id=None, medium="GPU", lora_name=None)])


@pytest.fixture
def publisher(tmp_path):
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/pub",
                            replay_endpoint=f"ipc://{tmp_path}/replay", buffer_steps=100, topic="kv")
    yield pub, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub.shutdown()


def collect(sub, n, timeout=10.0):
    got, deadline = [], time.time() + timeout
    while len(got) < n and time.time() < deadline:
        got.extend(sub.poll(200))
    return got


def publish(pub, seqs):
    for i in seqs:
        pub.publish(batch(i))
    time.sleep(0.2)


def test_batches_published_before_connecting_are_replayed(publisher):
    pub, ep, replay = publisher
    publish(pub, range(5))  # nobody listens: PUB drops these
    sub = Subscriber(ep, replay, topic="kv", start_seq=0)
    time.sleep(0.3)
    publish(pub, range(5, 8))
    got = collect(sub, 8)
    assert [s for s, _ in got] == list(range(8))
    assert [b.events[0].block_hashes[0] for _, b in got] == list(range(8))
    assert sub.stats.recovered == 5 and sub.stats.lost == 0 and sub.stats.gaps == 1
    sub.close()


def test_gap_in_the_middle_is_recovered(publisher):
    pub, ep, replay = publisher
    sub = Subscriber(ep, replay, topic="kv", start_seq=0)
    time.sleep(0.3)
    publish(pub, range(3))
    first = collect(sub, 3)
    sub.close()  # the subscriber goes away (restart, network blip) ...
    publish(pub, range(3, 6))  # ... and misses these
    sub = Subscriber(ep, replay, topic="kv", start_seq=sub.next_seq)
    time.sleep(0.3)
    publish(pub, range(6, 8))
    rest = collect(sub, 5)
    assert [s for s, _ in first + rest] == list(range(8))
    assert sub.stats.recovered == 3 and sub.stats.lost == 0
    sub.close()


def test_without_replay_the_loss_is_counted(publisher):
    pub, ep, _ = publisher
    publish(pub, range(2))
    sub = Subscriber(ep, None, topic="kv", start_seq=0)
    time.sleep(0.3)
    publish(pub, [2])
    assert [s for s, _ in collect(sub, 1)] == [2]
    assert sub.stats.lost == 2
    sub.close()


def tier_batch(i):
    """A CPU store and a disk-tier (STORAGE, LOCAL, owned) store and removal of hash i."""
    disk = {"medium": MEDIUM_STORAGE, "locality": "LOCAL", "ownership": "disk-0f3a"}
    common = {"block_hashes": [i], "parent_block_hash": None, "token_ids": [i] * 4, "block_size": 4,
              "lora_id": None, "lora_name": None}
    return KVEventBatch(ts=float(i), events=[
        BlockStored(**common, medium=MEDIUM_CPU), BlockStored(**common, **disk),
        BlockRemoved(block_hashes=[i], **disk)])


def test_cli_subscribe_shows_each_tier(publisher, tmp_path, capsys):
    pub, ep, replay = publisher
    out = tmp_path / "events.jsonl"

    def publish_later():
        time.sleep(0.5)
        for i in range(3):
            pub.publish(tier_batch(i))

    t = threading.Thread(target=publish_later)
    t.start()
    rc = cli.main(["subscribe", "--endpoint", ep, "--replay-endpoint", replay, "--topic", "kv",
                   "--validate", "--out", str(out), "--idle-timeout", "2", "--max-batches", "3"])
    t.join()
    summary = json.loads(capsys.readouterr().err)
    assert rc == 0 and summary["batches"] == 3
    assert summary["tiers"] == {"CPU": {"stored": 3, "removed": 0},
                                "STORAGE:LOCAL:disk-0f3a": {"stored": 3, "removed": 3}}
    assert summary["validator"]["tiers"]["STORAGE:LOCAL:disk-0f3a"]["held"] == 0
    first = json.loads(out.read_text().splitlines()[0])["batch"][1][1]
    assert (first["medium"], first["locality"], first["ownership"]) == ("STORAGE", "LOCAL", "disk-0f3a")
    assert [b.events[1].ownership for _, b in recording.read(open(out))] == ["disk-0f3a"] * 3
