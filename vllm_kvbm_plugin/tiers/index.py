"""The index of one tier: which block keys it holds, in which slot, and which are busy.

Invariants: a key is `ready` only after its bytes are complete where the slot says; a pinned entry
(being loaded or stored) is never evicted; slots are reused only after eviction.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import msgspec

from vllm_kvbm_plugin.tiers.policies import EvictionPolicy


class Entry(msgspec.Struct, gc=False):
    """One block the tier holds. Not tracked by Python's garbage collector: a tier holds up to
    millions of entries, which every full collection would walk (a pause in the scheduler's
    process that grows with the tier), so an entry and its `meta` must never be part of a
    reference cycle."""

    slot: int
    ready: bool = False
    pins: int = 0
    meta: Any = None  # what the owner needs to announce or find the block (events, file size)


class TierIndex:
    """One tier's entries by key: slots, readiness, pins and the eviction policy that picks
    victims among the unpinned. Pure; owned by a tier's scheduler side (TierManager,
    offloading/disk_tier.py) on the scheduler thread."""

    def __init__(self, capacity: int, policy: EvictionPolicy):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.policy = policy
        self.entries: dict[Hashable, Entry] = {}
        self._free: list[int] = []  # recycled slots; fresh ones come from _next
        self._next = 0
        self._pinned: set = set()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key) -> bool:
        return key in self.entries

    def ready(self, key) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.ready else None

    def touch(self, key) -> None:
        self.policy.touch(key)

    def touch_all(self, keys) -> None:
        self.policy.touch_all(keys)

    def reserve(self, key, parent=None, meta=None) -> tuple[Entry | None, list[tuple[Hashable, Entry]]]:
        """A slot for `key` (not ready until `complete`), evicting as needed.

        Returns (entry or None when nothing can be evicted or admission refuses, evicted entries).
        Reserved entries start pinned: the caller unpins after the copy in.
        """
        if key in self.entries:
            return None, []
        evicted = []
        while not self._free and self._next >= self.capacity:
            victim = self.policy.victim(self._pinned)
            if victim is None or not self.policy.admit(key, victim):
                return None, evicted
            evicted.append((victim, self.remove(victim)))
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._next = self._next, self._next + 1
        entry = Entry(slot=slot, pins=1, meta=meta)
        self.entries[key] = entry
        self._pinned.add(key)
        self.policy.add(key, parent)
        return entry, evicted

    def reserve_chain(self, keys, parent=None) -> list[Entry]:
        """reserve() of each of `keys` in turn, each under the key before it (the first under
        `parent`), for as long as free slots last: the same entries, slots and policy order, in one
        call. Stops before the first key held already or the first that would need an eviction
        (the caller goes on with reserve, which evicts); returns the entries made, in order."""
        entries, free = self.entries, self._free
        room = len(free) + max(0, self.capacity - self._next)
        made = []
        for key in keys:
            if len(made) == room or key in entries:
                break
            if free:
                slot = free.pop()
            else:
                slot, self._next = self._next, self._next + 1
            entry = entries[key] = Entry(slot=slot, pins=1)
            made.append(entry)
        if not made:
            return made
        chain = keys[:len(made)] if len(keys) != len(made) else keys
        self._pinned.update(chain)
        self.policy.add_chain(chain, parent)
        return made

    def complete(self, key) -> Entry | None:
        e = self.entries.get(key)
        if e is not None:
            e.ready = True
            self.unpin(key)
        return e

    def pin(self, key) -> None:
        e = self.entries[key]
        e.pins += 1
        self._pinned.add(key)

    def complete_all(self, keys) -> list:
        """complete() of each of `keys` in order; their entries (None where gone)."""
        get, pinned = self.entries.get, self._pinned
        out = []
        for key in keys:
            e = get(key)
            if e is not None:
                e.ready = True
                if e.pins:
                    e.pins -= 1
                    if not e.pins:
                        pinned.discard(key)
            out.append(e)
        return out

    def pin_all(self, keys) -> None:
        """pin() of each of `keys`."""
        entries, pinned = self.entries, self._pinned
        for key in keys:
            entries[key].pins += 1
        pinned.update(keys)

    def unpin_all(self, keys) -> None:
        """unpin() of each of `keys` (None: skipped)."""
        get, pinned = self.entries.get, self._pinned
        for key in keys:
            e = get(key)
            if e is None or e.pins == 0:
                continue
            e.pins -= 1
            if e.pins == 0:
                pinned.discard(key)

    def unpin(self, key) -> None:
        e = self.entries.get(key)
        if e is None or e.pins == 0:
            return
        e.pins -= 1
        if e.pins == 0:
            self._pinned.discard(key)

    def remove(self, key) -> Entry | None:
        e = self.entries.pop(key, None)
        if e is not None:
            self._pinned.discard(key)
            self.policy.remove(key)
            self._free.append(e.slot)
        return e

    def busy(self) -> int:
        """Entries currently pinned (0 when idle: the accounting check)."""
        return len(self._pinned)
