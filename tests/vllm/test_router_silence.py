"""A worker given the wrong endpoint form (`tcp://127.0.0.1:PORT`: vLLM's real ZmqEventPublisher then
connects instead of binding, as the router does) is warned about by `vllm-kvbm route` and
`vllm-kvbm subscribe`; a worker given `tcp://*:PORT` is not. And, on the same real publishers,
what a routing decision waits for: the answering workers' streams, never a busy one's traffic."""

import contextlib
import logging
import threading
import time

import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from vllm_kvbm_plugin import cli
from vllm_kvbm_plugin.router import Router, Worker
from vllm_kvbm_plugin.testing.redis_server import _free_ports


def batch(i):
    return KVEventBatch(ts=float(i), events=[BlockStored(
        block_hashes=[i], parent_block_hash=None, token_ids=[i] * 16, block_size=16,
        lora_id=None, medium="GPU", lora_name=None)])


@contextlib.contextmanager
def warnings_of(name):
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.fixture
def publishers(tmp_path):
    made = []

    def make(endpoint, i):
        made.append(ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint,
                                      replay_endpoint=f"ipc://{tmp_path}/replay{i}", topic="kv"))
        return made[-1]
    yield make
    for p in made:
        p.shutdown()


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_the_router_warns_about_a_worker_whose_publisher_connects(publishers):
    wrong, right = _free_ports(2)
    bad = publishers(f"tcp://127.0.0.1:{wrong}", 0)  # as docs/router.md once said: it connects
    good = publishers(f"tcp://*:{right}", 1)
    router = Router([Worker.parse(f"http://127.0.0.1:8001,tcp://127.0.0.1:{wrong}"),
                     Worker.parse(f"http://127.0.0.1:8002,tcp://127.0.0.1:{right}")],
                    topic="kv", settle_s=0, silence_s=0.5)
    with warnings_of("vllm.kvbm.subscriber") as records:
        router.start()
        try:
            time.sleep(0.3)  # let the SUB sockets connect
            for i in (0, 1):  # both workers served a request; each publisher sends its events
                router.done(i, {"policy": "kv", "prompt_tokens": 32, "predicted": 0, "served": 0, "scores": [0, 0]})
            for i in range(3):
                bad.publish(batch(i))
                good.publish(batch(i))
            assert wait_for(lambda: router.stats()["silent_streams"]), router.stats()["streams"]
            time.sleep(0.3)
            stats = router.stats()
        finally:
            router.stop()
    assert stats["silent_streams"] == ["http://127.0.0.1:8001"]
    silent, heard = stats["streams"]
    assert silent["batches"] == 0 and silent["silent_s"] >= 0.5 and silent["events"] == f"tcp://127.0.0.1:{wrong}"
    assert heard["batches"] == 3 and heard["silent_s"] is None
    said = [r.getMessage() for r in records]
    assert len(said) == 1, said  # once per silence
    assert "worker http://127.0.0.1:8001" in said[0] and f"tcp://127.0.0.1:{wrong}" in said[0]
    assert "binds only tcp://*:PORT" in said[0]


def test_subscribe_warns_when_nothing_arrives_since_connecting(publishers, capsys):
    wrong, right = _free_ports(2)
    bad = publishers(f"tcp://127.0.0.1:{wrong}", 0)
    good = publishers(f"tcp://*:{right}", 1)
    with warnings_of("vllm.kvbm.subscriber") as records:
        for port, pub in ((wrong, bad), (right, good)):
            threading.Timer(0.3, lambda p=pub: [p.publish(batch(i)) for i in range(3)]).start()
            assert cli.main(["subscribe", "--endpoint", f"tcp://127.0.0.1:{port}", "--replay-endpoint",
                             pub.get_publisher_config().replay_endpoint, "--topic", "kv", "--quiet",
                             "--silence-warning", "0.5", "--idle-timeout", "1"]) == 0
    said = [r.getMessage() for r in records]
    assert len(said) == 1 and f"no KV events from tcp://127.0.0.1:{wrong}" in said[0], said
    assert "tcp://*:PORT" in said[0]
    err = capsys.readouterr().err
    assert '"batches": 0' in err and '"batches": 3' in err


def test_help_says_which_endpoints_the_publisher_binds(capsys):
    for cmd in ("route", "subscribe"):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "binds only tcp://*:PORT, ipc://" in out and "--silence-warning" in out


def test_an_announcer_streams_remote_blocks_score_every_worker(publishers, tmp_path):
    """`--announcer`: the remote tier's announcer (vLLM's real publisher here) feeds the index; its
    remote blocks count for workers that published nothing (`--remote all`)."""
    from vllm_kvbm_plugin.events.index import WorkerConfig
    from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher

    ann = publishers(f"ipc://{tmp_path}/ann", 2)
    router = Router([Worker.parse(f"http://127.0.0.1:8001,ipc://{tmp_path}/w0"),
                     Worker.parse(f"http://127.0.0.1:8002,ipc://{tmp_path}/w1")], topic="kv", settle_s=0,
                    config=WorkerConfig(hash_block_size=16, remote="all"),
                    announcers=[Worker.announcer(f"ipc://{tmp_path}/ann,ipc://{tmp_path}/replay2")])
    prompt = list(range(100, 200))
    hs = PromptHasher().event_hashes(prompt, 16)
    router.start()
    try:
        time.sleep(0.3)
        ann.publish(KVEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=hs[:3], parent_block_hash=None, token_ids=prompt[:48], block_size=16, lora_id=None,
            medium="STORAGE", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
            locality="REMOTE", ownership="kvbm-remote:ab")]))
        assert wait_for(lambda: router.scores(prompt) == [48, 48]), router.scores(prompt)
    finally:
        router.stop()


def test_routing_after_an_answer_waits_for_its_events(publishers, tmp_path):
    """Read your writes: a response can overtake its KV events (CI once saw a repeated prompt
    predicted 0 and served 800). The next decision waits for the answering worker's batch."""
    from vllm_kvbm_plugin.events.index import WorkerConfig
    from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher

    pub = publishers(f"ipc://{tmp_path}/w0", 0)
    router = Router([Worker.parse(f"http://127.0.0.1:8001,ipc://{tmp_path}/w0,ipc://{tmp_path}/replay0"),
                     Worker.parse(f"http://127.0.0.1:8002,ipc://{tmp_path}/w1")], topic="kv", settle_s=0,
                    config=WorkerConfig(hash_block_size=16))
    prompt = list(range(100, 200))
    hs = PromptHasher().event_hashes(prompt, 16)
    router.start()
    try:
        time.sleep(0.3)
        sent = router.sent(0)
        router.done(0, {"policy": "kv", "prompt_tokens": 100, "predicted": 0, "served": 0, "scores": [0, 0]},
                    sent=sent)
        threading.Timer(0.3, lambda: pub.publish(KVEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=hs, parent_block_hash=None, token_ids=prompt[:96], block_size=16, lora_id=None,
            medium="GPU", lora_name=None)]))).start()
        t0 = time.monotonic()
        chosen = router.choose(prompt)[:2]
        waited = time.monotonic() - t0
        # a full hit: stores nothing new, so the next decision does not wait
        router.done(0, {"policy": "kv", "prompt_tokens": 100, "predicted": 96, "served": 96, "scores": [96, 0]},
                    sent=router.sent(0))
        t0 = time.monotonic()
        router.choose(prompt)
        again = time.monotonic() - t0
    finally:
        router.stop()
    assert chosen == (0, [96, 0]) and 0.2 < waited < 1.0, (chosen, waited)
    assert again < 0.1, again


def test_a_busy_stream_does_not_hold_up_a_decision(publishers, tmp_path):
    """Worker B publishes a batch every 5 ms (a busy fleet never falls quiet) and worker A answered
    a request whose events come late. A decision waits for A's stream to catch up with A's answer
    and no longer: not for a lull of every stream (which never came: each decision waited the full
    second), nor for B's traffic; an answer of B's is caught up by B's next batch."""
    from vllm_kvbm_plugin.events.index import WorkerConfig
    from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher

    a, b = publishers(f"ipc://{tmp_path}/w0", 0), publishers(f"ipc://{tmp_path}/w1", 1)
    router = Router([Worker.parse(f"http://127.0.0.1:8001,ipc://{tmp_path}/w0,ipc://{tmp_path}/replay0"),
                     Worker.parse(f"http://127.0.0.1:8002,ipc://{tmp_path}/w1,ipc://{tmp_path}/replay1")],
                    topic="kv", settle_s=0.8, config=WorkerConfig(hash_block_size=16))
    prompt = list(range(100, 200))
    hs = PromptHasher().event_hashes(prompt, 16)
    record = {"policy": "kv", "prompt_tokens": 100, "predicted": 0, "served": 0, "scores": [0, 0]}
    stop = threading.Event()

    def busy():  # stamped as vLLM stamps a step's batch: time.time() when published
        n = 0
        while not stop.wait(0.005):
            b.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[10 ** 6 + n], parent_block_hash=None, token_ids=[n % 50] * 16, block_size=16,
                lora_id=None, medium="GPU", lora_name=None)]))
            n += 1

    router.start()
    threading.Thread(target=busy, daemon=True).start()
    try:
        time.sleep(0.3)
        router.done(1, record, sent=router.sent(1))
        t0 = time.monotonic()
        router.choose(prompt)
        b_took = time.monotonic() - t0
        router.done(0, record, sent=router.sent(0))
        threading.Timer(0.2, lambda: a.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=hs, parent_block_hash=None, token_ids=prompt[:96], block_size=16, lora_id=None,
            medium="GPU", lora_name=None)]))).start()
        t0 = time.monotonic()
        chosen = router.choose(prompt)
        a_took = time.monotonic() - t0
        batches = router.stats()["streams"][1]["batches"]
    finally:
        stop.set()
        router.stop()
    # caught up by the batches themselves: before settle_s (0.8 s) or the deadline (1 s) could end the wait
    assert chosen[:2] == (0, [96, 0]) and 0.2 <= chosen.waited_s <= a_took < 0.6, (chosen, a_took)
    assert b_took < 0.5 and batches > 20, (b_took, batches)
