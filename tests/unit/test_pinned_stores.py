"""tiers/pinned.py: a store in flight pins its parent (never evicted before the child settles),
and a restart indexes parents before children."""

import random

import pytest

from vllm_kvbm_plugin.tiers.index import TierIndex
from vllm_kvbm_plugin.tiers.pinned import PinnedStores, restore
from vllm_kvbm_plugin.tiers.policies import LRU, POLICIES, make_policy


def test_a_store_pins_its_parent_until_settled():
    index = TierIndex(2, LRU())
    stores = PinnedStores(index)
    stores.reserve("a")
    stores.settle("a", True)
    assert stores.reserve("b", "a")[0] is not None
    assert stores.reserve("c") == (None, []) and "a" in index  # the parent cannot be evicted
    entry, parent = stores.settle("b", True)
    assert entry.ready and parent == "a" and index.busy() == 0
    entry, evicted = stores.reserve("c")
    assert entry is not None and [k for k, _ in evicted] == ["a"]  # now it can
    assert stores.settle("c", False) == (None, None) and "c" not in index  # a failed store is dropped


def test_restore_indexes_parents_first():
    found = [("c", "b", 96, None), ("a", None, 32, None), ("b", "a", 64, None), ("x", "gone", 32, None)]
    index = TierIndex(8, LRU())
    assert restore(index, found, list) == ["a", "x", "b", "c"] and all(index.ready(k) for k in "axbc")
    index, gone = TierIndex(2, LRU()), []
    assert restore(index, found, gone.extend) == ["b", "c"]  # more than fits: the policy evicts
    assert [k for k, _ in gone] == ["a", "x"] and index.busy() == 0


def _state(index: TierIndex, stores: PinnedStores):
    """Everything a tier's behaviour depends on: entries, slots, pins, free slots, parents and
    the policy's eviction order (its victims, as many as can go)."""
    entries = {k: (e.slot, e.ready, e.pins) for k, e in index.entries.items()}
    victims = None
    for n in range(len(index.entries) - len(index._pinned), 0, -1):
        victims = index.policy.victims(n, index._pinned)
        if victims is not None:
            break
    parents = {k: p.key if p else None for k, (_, p) in stores.stores.items()}
    return entries, sorted(index._pinned), list(index._free), index._next, parents, victims


@pytest.mark.parametrize("policy", POLICIES)
def test_chains_match_one_key_at_a_time(policy):
    """reserve_chain / settle_landed (a request's run of blocks in one call) leave the index,
    pins, slots and eviction order exactly as reserve / settle key by key would; fails if the
    chain skips a pin, a parent, a slot or reorders the policy."""
    rng = random.Random(policy)
    one, many = TierIndex(40, make_policy(policy)), TierIndex(40, make_policy(policy))
    s_one, s_many = PinnedStores(one), PinnedStores(many)
    landed: list = []
    for step in range(300):
        if rng.random() < 0.5 and landed:  # some stores land, in order
            n = rng.randrange(1, len(landed) + 1)
            batch, landed = landed[:n], landed[n:]
            expect = [s_one.settle(k, True) for k in batch]
            got = s_many.settle_landed(batch)
            assert [(e is not None, p) for e, p in expect] == [(e is not None, p) for e, p in got]
        else:  # a request's run of new blocks: chained keys under a held (or no) parent
            held = [k for k, e in one.entries.items() if e.ready]
            parent = rng.choice(held) if held and rng.random() < 0.7 else None
            keys = [f"{step}.{i}" for i in range(rng.randrange(1, 12))]
            made = s_many.reserve_chain(keys, parent)
            p, expect = parent, []
            for k in keys[:len(made)]:
                entry, evicted = s_one.reserve(k, p)
                assert entry is not None and not evicted
                expect.append(entry.slot)
                p = k
            assert [e.slot for e in made] == expect
            rest = keys[len(made):]
            if rest:  # no free slot left: the caller goes on key by key, evicting
                assert len(one._free) + one.capacity - one._next == 0
            for k in rest:
                a, b = s_one.reserve(k, p), s_many.reserve(k, p)
                assert (a[0] is None) == (b[0] is None) and [k for k, _ in a[1]] == [k for k, _ in b[1]]
                if a[0] is None:
                    break
                p = k
                made.append(b[0])
            landed += keys[:len(made)]
        assert _state(one, s_one) == _state(many, s_many)
    touched = list(one.entries)[::3]
    for k in touched:
        one.touch(k)
    many.touch_all(touched)
    assert _state(one, s_one) == _state(many, s_many)
