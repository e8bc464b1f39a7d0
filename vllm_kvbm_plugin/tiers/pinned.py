"""Stores that pin their parent: the one protocol every tier with an index follows, so a router
never sees a block whose parent the tier no longer holds.

A store reserves the child's entry (not ready) and pins its parent until the store is settled:
an eviction meanwhile cannot take the parent, so the parent's removal is never announced before
the child's store. At restart the entries an earlier run left are indexed parents first (by where
each one's tokens end). Pure: no vLLM, no files.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from vllm_kvbm_plugin.tiers.index import Entry, TierIndex


class PinnedStores:
    """The stores in flight of one TierIndex, each with its entry and the parent's entry it pins.
    Owned by a tier's scheduler side (connector/tier_manager.py TierManager, offloading/disk_tier.py
    KVBMDiskTier), on the scheduler thread. Holds no reference back to its owner: no cycle keeps a
    tier alive."""

    def __init__(self, index: TierIndex) -> None:
        self.index = index
        # key -> (its entry, its parent's entry pinned until settled, or None)
        self.stores: dict[Hashable, tuple[Entry, Entry | None]] = {}

    def reserve(self, key: Hashable, parent: Hashable | None = None,
                meta: Any = None) -> tuple[Entry | None, list[tuple[Hashable, Entry]]]:
        """(an entry for `key`, pinned, not ready, under `parent`, pinned until `settle`; or None
        when the tier has no room, and the (key, Entry) pairs evicted by the policy meanwhile)."""
        index = self.index
        held = index.pin(parent) if parent is not None else None
        entry, evicted = index.reserve(key, parent, meta)
        if entry is None:
            index.unpin(held)
        else:
            self.stores[key] = (entry, held)
        return entry, evicted

    def reserve_chain(self, keys: Sequence[Hashable], parent: Hashable | None = None) -> list[Entry]:
        """reserve() of each of `keys` in turn, each under the key before it (the first under
        `parent`), while the index has free slots (TierIndex.reserve_chain): a request's run of
        new blocks in one call. Returns the entries made; the caller reserves the rest one by one."""
        index = self.index
        made = index.reserve_chain(keys, parent)
        if made:
            first = index.pin(parent) if parent is not None else None
            parents = [first, *index.pin_all(keys[:len(made) - 1])]
            self.stores.update(zip(keys, zip(made, parents)))
        return made

    def settle_landed(self, keys: Iterable[Hashable]) -> list[tuple[Entry | None, Hashable | None]]:
        """settle(key, True) of each of `keys` in order: [(the ready entry or None, its parent)]."""
        pop = self.stores.pop
        settled = [pop(key, (None, None)) for key in keys]
        index = self.index
        index.unpin_all([held for _, held in settled])
        done = index.complete_all([entry for entry, _ in settled])
        return [(e, held.key if held is not None else None) for e, (_, held) in zip(done, settled)]

    def settle(self, key: Hashable, ok: bool) -> tuple[Entry | None, Hashable | None]:
        """The store of `key` ended: ready (ok) or dropped; its parent is released. Returns (the
        ready entry or None, the parent it was stored under)."""
        entry, held = self.stores.pop(key, (None, None))
        index = self.index
        index.unpin(held)
        parent = held.key if held is not None else None
        if entry is None:
            return None, parent
        if ok:
            return index.complete(entry), parent
        if index.entries.get(key) is entry:
            index.remove(key)
        index.unpin(entry)  # the reservation's pin: the slot is free once no load pins it either
        return None, parent


def restore(index: TierIndex, found: Iterable, evicted: Callable[[list], None]) -> list:
    """Index what an earlier run stored, `found` as (key, parent, end, meta), parents first (by
    `end`, where the entry's tokens end), each ready and under its parent where the index holds
    it. Returns the keys indexed, in that order (more than the capacity allows: the policy evicts
    some, handed to `evicted`)."""
    out = []
    for key, parent, _end, meta in sorted(found, key=lambda f: f[2]):
        entry, gone = index.reserve(key, parent if parent in index else None, meta)
        evicted(gone)
        if entry is not None:
            index.complete(entry)
            out.append(key)
    return [k for k in out if k in index]
