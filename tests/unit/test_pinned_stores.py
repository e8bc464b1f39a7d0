"""tiers/pinned.py: a store in flight pins its parent (never evicted before the child settles),
and a restart indexes parents before children."""

from vllm_kvbm_plugin.tiers.index import TierIndex
from vllm_kvbm_plugin.tiers.pinned import PinnedStores, restore
from vllm_kvbm_plugin.tiers.policies import LRU


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
