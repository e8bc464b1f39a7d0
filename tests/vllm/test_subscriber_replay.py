"""Our Subscriber against vLLM's real ZmqEventPublisher (PUB + replay ROUTER on ipc sockets)."""

import time

import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

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
