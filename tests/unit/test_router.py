"""The router's choice: most servable tokens per the index, ties to the least loaded worker, and
round-robin on request (the HTTP path runs end to end in tests/serve/test_router.py)."""

import random
import time

import pytest

from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher
from vllm_kvbm_plugin.events.types import BlockStored, KVEventBatch
from vllm_kvbm_plugin.router import Router, Worker

rng = random.Random(7)


def toks(n):
    return [rng.randrange(10, 2000) for _ in range(n)]


def store(router, url, prompt, unit=16):
    hs = PromptHasher().event_hashes(prompt, unit)
    ev = BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=prompt[:len(hs) * unit], block_size=unit,
                     lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention")
    router.index.apply(url, KVEventBatch(0.0, [ev]))


def make_router(tmp_path, **kw):
    workers = [Worker.parse(f"http://127.0.0.1:{9000 + i},ipc://{tmp_path}/ev{i},ipc://{tmp_path}/rp{i}")
               for i in range(2)]
    return Router(workers, settle_s=0, **kw)


def test_worker_spec():
    w = Worker.parse("http://127.0.0.1:8000/,tcp://127.0.0.1:5557")
    assert (w.url, w.events, w.replay) == ("http://127.0.0.1:8000", "tcp://127.0.0.1:5557", None)
    with pytest.raises(ValueError, match="URL,EVENTS_ENDPOINT"):
        Worker.parse("http://127.0.0.1:8000")


def test_most_servable_tokens_then_least_loaded(tmp_path):
    router = make_router(tmp_path)
    a, b = toks(100), toks(100)
    store(router, router.workers[1].url, a)
    store(router, router.workers[0].url, b[:48])
    assert router.choose(a) == (1, [0, 96])
    assert router.choose(b) == (0, [48, 0])
    router.done(1, {"policy": "kv", "prompt_tokens": 100, "predicted": 96, "served": 96, "scores": [0, 96]})
    # a tie: worker 0 has a request in flight, worker 1 none
    assert router.choose(toks(50))[0] == 1
    stats = router.stats()
    assert stats["by_policy"]["kv"] == {"requests": 1, "served": 96, "predicted": 96, "mispredicted": 0}


def test_round_robin_on_request(tmp_path):
    router = make_router(tmp_path)
    a = toks(100)
    store(router, router.workers[1].url, a)
    assert [router.choose(a, "round-robin")[0] for _ in range(3)] == [0, 1, 0]
    with pytest.raises(ValueError, match="unknown policy"):
        make_router(tmp_path, policy="random")


def test_only_an_answered_request_makes_events_due(tmp_path):
    router = make_router(tmp_path, silence_s=0.01)
    record = {"policy": "kv", "prompt_tokens": 8, "predicted": 0, "served": None, "scores": [0, 0]}
    router.done(0, record, answered=False)  # the worker was unreachable: it published nothing
    router.done(1, record)
    time.sleep(0.05)
    assert router.stats()["silent_streams"] == [router.workers[1].url]
    router.watches[1].delivered(1)  # a batch arrived: the stream works
    assert router.stats()["silent_streams"] == []
    never = make_router(tmp_path, silence_s=0)  # --silence-warning 0
    never.done(0, record)
    time.sleep(0.05)
    assert never.stats()["silent_streams"] == []


def test_a_shared_remote_tier_scores_for_a_worker_that_published_nothing(tmp_path):
    from vllm_kvbm_plugin.events.index import WorkerConfig

    router = make_router(tmp_path, config=WorkerConfig(hash_block_size=16, remote="all"))
    a = toks(100)
    hs = PromptHasher().event_hashes(a, 16)
    remote = BlockStored(block_hashes=hs[:4], parent_block_hash=None, token_ids=a[:64], block_size=16, lora_id=None,
                         medium="STORAGE", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
                         locality="REMOTE", ownership="kvbm-remote:ab")
    router.index.apply(router.workers[0].url, KVEventBatch(0.0, [remote], 0))
    store(router, router.workers[0].url, a[:32])
    assert router.scores(a) == [64, 64]  # worker 1 reads the store worker 0 wrote into


def test_announcer_streams_are_followed_never_routed_to(tmp_path):
    a = Worker.announcer(f"ipc://{tmp_path}/ann,ipc://{tmp_path}/ann-replay")
    assert (a.url, a.events, a.replay) == (f"announcer:ipc://{tmp_path}/ann", f"ipc://{tmp_path}/ann", f"ipc://{tmp_path}/ann-replay")
    with pytest.raises(ValueError, match="EVENTS_ENDPOINT"):
        Worker.announcer("a,b,c")
    router = make_router(tmp_path, announcers=[a])
    assert len(router._threads) == 3 and len(router.workers) == 2
