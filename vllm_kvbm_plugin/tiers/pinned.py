"""Stores that pin their parent: the one protocol every tier with an index follows, so a router
never sees a block whose parent the tier no longer holds.

A store reserves the child's entry (not ready) and pins its parent until the store is settled:
an eviction meanwhile cannot take the parent, so the parent's removal is never announced before
the child's store. At restart the entries an earlier run left are indexed parents first (by where
each one's tokens end). Pure: no vLLM, no files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vllm_kvbm_plugin.tiers.index import Entry, TierIndex


class PinnedStores:
    """The stores in flight of one TierIndex, each with the parent it pins. Owned by a tier's
    scheduler side (connector/cpu_tier.py TierManager, offloading/disk_tier.py KVBMDiskTier), on
    the scheduler thread. Holds no reference back to its owner: no cycle keeps a tier alive."""

    def __init__(self, index: TierIndex):
        self.index = index
        self.parents: dict = {}  # key -> its parent, pinned until the key is settled

    def reserve(self, key, parent=None, meta=None) -> tuple[Entry | None, list]:
        """(an entry for `key`, pinned, not ready, under `parent`, pinned until `settle`; or None
        when the tier has no room, and the (key, Entry) pairs evicted by the policy meanwhile)."""
        index = self.index
        if parent is not None:
            index.pin(parent)
        entry, evicted = index.reserve(key, parent, meta)
        if entry is None:
            if parent is not None:
                index.unpin(parent)
        elif parent is not None:
            self.parents[key] = parent
        return entry, evicted

    def reserve_chain(self, keys, parent=None) -> list[Entry]:
        """reserve() of each of `keys` in turn, each under the key before it (the first under
        `parent`), while the index has free slots (TierIndex.reserve_chain): a request's run of
        new blocks in one call. Returns the entries made; the caller reserves the rest one by one."""
        index = self.index
        made = index.reserve_chain(keys, parent)
        n = len(made)
        if n:
            chain = keys[:n] if len(keys) != n else keys
            parents = [parent, *chain[:-1]]
            if parent is None:
                index.pin_all(parents[1:])
            else:
                index.pin_all(parents)
            self.parents.update(zip(chain, parents) if parent is not None else zip(chain[1:], chain))
        return made

    def settle_landed(self, keys) -> list:
        """settle(key, True) of each of `keys` in order: [(the ready entry or None, its parent)]."""
        pop = self.parents.pop
        parents = [pop(key, None) for key in keys]
        self.index.unpin_all(parents)
        return list(zip(self.index.complete_all(keys), parents))

    def settle(self, key, ok: bool):
        """The store of `key` ended: ready (ok) or dropped; its parent is released. Returns (the
        ready entry or None, the parent it was stored under)."""
        parent = self.parents.pop(key, None)
        if parent is not None:
            self.index.unpin(parent)
        if ok:
            return self.index.complete(key), parent
        self.index.remove(key)
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
            index.complete(key)
            out.append(key)
    return [k for k in out if k in index]
