"""Our policies as vLLM CachePolicy classes, inside vLLM's own CPUOffloadingManager (0.32 and 0.33)."""

import pytest
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from vllm_kvbm_plugin.testing.offloading_drive import Request, chunk_key

MODULE = "vllm_kvbm_plugin.offloading"


def manager(policy: str, chunks: int) -> CPUOffloadingManager:
    if policy in ("lru", "arc"):
        return CPUOffloadingManager(num_chunks=chunks, cache_policy=policy, enable_events=True)
    return CPUOffloadingManager(num_chunks=chunks, cache_policy=policy, cache_policy_module_path=MODULE,
                                enable_events=True)


def held(m) -> set:
    return set(m._policy.chunks)


def evictions_with_children_held(m, steps: list, chains: dict) -> tuple[list, list]:
    """Run `steps`; return (evicted keys in order, those evicted while a child of theirs in
    `chains` (child -> parent) was still held)."""
    order, bad = [], []
    children = {}
    for child, parent in chains.items():
        children.setdefault(parent, []).append(child)
    for run in steps:
        alive = held(m)
        run()
        for ev in m.take_events():
            if ev.removed:
                for k in ev.keys:  # in eviction order
                    if any(c in alive for c in children.get(k, [])):
                        bad.append(k)
                    alive.discard(k)
                    order.append(k)
    return order, bad


def lineage_workload(m):
    """Chain a <- b <- c stored by one request, x by another; then a request whose prefix sits in
    GPU memory loads only c (so c is the most recent chunk), then three new chunks need room."""
    a, b, c, x = (chunk_key(n) for n in "abcx")
    news = [chunk_key(f"n{i}") for i in range(3)]
    r1 = Request(m, [a, b, c])
    rx = Request(m, [x])
    r2 = Request(m, [a, b, c])
    r3 = Request(m, news)

    def store_chain():
        r1.store()
        r1.finish()

    def store_x():
        rx.store()
        rx.finish()

    def load_tail_only():
        r2.load([c])
        r2.finish()

    steps = [store_chain, store_x, load_tail_only]
    steps += [lambda i=i: r3.store(news[: i + 1]) for i in range(3)]
    return steps, {b: a, c: b}


@pytest.mark.parametrize("policy", ["LineageCachePolicy", "lru"])
def test_lineage_never_evicts_a_parent_before_its_child(policy):
    m = manager(policy, 4)
    steps, chains = lineage_workload(m)
    order, bad = evictions_with_children_held(m, steps, chains)
    assert len(order) == 3
    a, b, c, x = (chunk_key(n) for n in "abcx")
    if policy == "LineageCachePolicy":
        assert bad == [] and order == [x, c, b] and a in held(m)
    else:  # vLLM's lru evicts the chain's head while its tail is held: the workload has teeth
        assert bad and order[0] == b and c in held(m)


def test_lineage_links_keys_stored_across_steps():
    """The parent of the first chunk of a later store is the last chunk of an earlier one."""
    m = manager("LineageCachePolicy", 8)
    keys = [chunk_key(f"k{i}") for i in range(4)]
    r = Request(m, keys)
    r.store(keys[:2])
    r.store(keys[2:])
    r.finish()
    pol = m._policy.policy
    assert pol._parent[keys[2]] == keys[1] and pol._parent[keys[1]] == keys[0]
    assert list(pol._leaves) == [keys[3]]


def hot_prefix_then_scan(m, chunks: int) -> tuple[list, list]:
    """A 4-chunk prefix reused by 5 requests, then one scan of 3x the tier's size of cold chunks
    (stored 2 at a time by requests that are never seen again)."""
    hot = [chunk_key(f"hot{i}") for i in range(4)]
    store_and_reuse(m, hot, 5)
    cold = [chunk_key(f"cold{i}") for i in range(3 * chunks)]
    for i in range(0, len(cold), 2):
        s = Request(m, cold[i: i + 2])
        s.store()
        s.finish()
    return hot, cold


def store_and_reuse(m, keys: list, uses: int) -> None:
    """One request stores `keys`, then `uses` requests load them."""
    r = Request(m, keys)
    r.store()
    r.finish()
    for _ in range(uses):
        r = Request(m, keys)
        r.load(keys)
        r.finish()


@pytest.mark.parametrize("policy", ["MultiLRUCachePolicy", "lru"])
def test_multi_lru_keeps_a_hot_prefix_through_a_scan(policy):
    m = manager(policy, 8)
    hot, cold = hot_prefix_then_scan(m, 8)
    kept = [k for k in hot if k in held(m)]
    if policy == "MultiLRUCachePolicy":
        assert kept == hot
        assert any(k in held(m) for k in cold)  # the scan still used the cold part of the tier
    else:
        assert kept == []  # vLLM's lru: one scan flushed the hot prefix


def test_multi_lru_admits_a_newcomer_asked_for_often_enough():
    """A tier full of hot chunks refuses one-off newcomers, but admits one requested repeatedly."""
    m = manager("MultiLRUCachePolicy", 2)
    hot = [chunk_key("h0"), chunk_key("h1")]
    store_and_reuse(m, hot, 2)
    once = Request(m, [chunk_key("once")])
    assert once.store() is None and held(m) == set(hot)
    once.finish()
    wanted = chunk_key("wanted")
    for _ in range(4):  # each request misses it again (a store miss is an access)
        w = Request(m, [wanted])
        out = w.store()
        w.finish()
        if out is not None:
            break
    assert wanted in held(m) and len(held(m)) == 2


@pytest.mark.parametrize("policy", ["LineageCachePolicy", "MultiLRUCachePolicy"])
def test_policies_keep_vllm_manager_accounting(policy):
    """Busy chunks are never victims, failed stores leave nothing behind, reset clears all."""
    m = manager(policy, 3)
    keys = [chunk_key(f"p{i}") for i in range(3)]
    r = Request(m, keys)
    r.store()
    r.finish()
    reader = Request(m, keys)
    spec = m.prepare_load(keys, reader.ctx)  # all three pinned by a load in flight
    other = Request(m, [chunk_key("other")])
    assert other.store() is None  # nothing evictable
    m.complete_load(keys, reader.ctx)
    reader.finish()
    assert len(spec.block_ids) == 3
    failed = Request(m, [chunk_key("f0")])
    out = failed.store(success=False)
    if out is not None:
        assert chunk_key("f0") not in held(m)
    m.reset_cache()
    assert held(m) == set() and len(m._policy.policy) == 0
