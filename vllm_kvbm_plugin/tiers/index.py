"""The index of one tier: which block keys it holds, in which slot, and which are busy.

Invariants: a key is `ready` only after its bytes are complete where the slot says; a pinned entry
(being loaded or stored) is never evicted; a slot is reused only once its entry is removed and
unpinned. Pins belong to an entry, not to its key: whoever pins holds the Entry and unpins that
entry, so a late unpin after the key was removed and stored anew never touches the new entry.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import Any

import msgspec

from vllm_kvbm_plugin.tiers.policies import EvictionPolicy


class Entry(msgspec.Struct, gc=False):
    """One block the tier holds. Not tracked by Python's garbage collector: a tier holds up to
    millions of entries, which every full collection would walk (a pause in the scheduler's
    process that grows with the tier), so an entry and its `meta` must never be part of a
    reference cycle."""

    key: Any
    slot: int
    ready: bool = False
    pins: int = 0
    meta: Any = None  # what the owner needs to announce or find the block (events, file size)


class TierIndex:
    """One tier's entries by key: slots, readiness, pins and the eviction policy that picks
    victims among the unpinned. Pure; owned by a tier's scheduler side (TierManager,
    offloading/disk_tier.py) on the scheduler thread."""

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.policy = policy
        self.entries: dict[Hashable, Entry] = {}
        self._free: list[int] = []  # recycled slots; fresh ones come from _next
        self._next = 0
        self._pinned: set = set()  # keys whose entry is pinned
        self._removed_pinned = 0  # entries removed while pinned: their slots are freed by their last unpin

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def ready(self, key: Hashable) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.ready else None

    def touch(self, key: Hashable) -> None:
        self.policy.touch(key)

    def touch_all(self, keys: Iterable[Hashable]) -> None:
        self.policy.touch_all(keys)

    def reserve(self, key: Hashable, parent: Hashable | None = None,
                meta: Any = None) -> tuple[Entry | None, list[tuple[Hashable, Entry]]]:
        """A slot for `key` (not ready until `complete`), evicting as needed.

        Returns (entry or None when nothing can be evicted or admission refuses, evicted entries).
        Reserved entries start pinned: the caller completes (or unpins) the entry after the copy in.
        """
        if key in self.entries:
            return None, []
        evicted: list[tuple[Hashable, Entry]] = []
        while not self._free and self._next >= self.capacity:
            victim = self.policy.victim(self._pinned)
            if victim is None or not self.policy.admit(key, victim):
                return None, evicted
            gone = self.remove(victim)
            assert gone is not None  # the policy names held keys only
            evicted.append((victim, gone))
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._next = self._next, self._next + 1
        entry = Entry(key, slot, pins=1, meta=meta)
        self.entries[key] = entry
        self._pinned.add(key)
        self.policy.add(key, parent)
        return entry, evicted

    def reserve_chain(self, keys: Sequence[Hashable], parent: Hashable | None = None) -> list[Entry]:
        """reserve() of each of `keys` in turn, each under the key before it (the first under
        `parent`), for as long as free slots last: the same entries, slots and policy order, in one
        call. Stops before the first key held already or the first that would need an eviction
        (the caller goes on with reserve, which evicts); returns the entries made, in order."""
        entries, free = self.entries, self._free
        room = len(free) + max(0, self.capacity - self._next)
        made: list[Entry] = []
        for key in keys:
            if len(made) == room or key in entries:
                break
            if free:
                slot = free.pop()
            else:
                slot, self._next = self._next, self._next + 1
            entry = entries[key] = Entry(key, slot, pins=1)
            made.append(entry)
        if not made:
            return made
        chain = keys[:len(made)] if len(keys) != len(made) else keys
        self._pinned.update(chain)
        self.policy.add_chain(chain, parent)
        return made

    def complete(self, entry: Entry) -> Entry | None:
        """The copy into a reserved `entry` ended well: it is ready (unless it was removed
        meanwhile: then None) and its reservation's pin is released."""
        return self.complete_all((entry,))[0]

    def complete_all(self, entries: Iterable[Entry | None]) -> list[Entry | None]:
        """complete() of each of `entries` in order (None: skipped, None out)."""
        get = self.entries.get
        out: list[Entry | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            live = get(e.key) is e
            if live:
                e.ready = True
            if e.pins:
                e.pins -= 1
                if not e.pins:
                    self._unpinned(e, live)
            out.append(e if live else None)
        return out

    def pin(self, key: Hashable) -> Entry:
        """Pin the entry of `key` (held: KeyError otherwise); unpin() that entry to release it."""
        e = self.entries[key]
        e.pins += 1
        self._pinned.add(key)
        return e

    def pin_all(self, keys: Collection[Hashable]) -> list[Entry]:
        """pin() of each of `keys`: their entries."""
        entries = self.entries
        out = [entries[key] for key in keys]
        for e in out:
            e.pins += 1
        self._pinned.update(keys)
        return out

    def unpin(self, entry: Entry | None) -> None:
        """Release one pin of `entry` (None: nothing). The last pin of an entry removed meanwhile
        frees its slot."""
        self.unpin_all((entry,))

    def unpin_all(self, entries: Iterable[Entry | None]) -> None:
        """unpin() of each of `entries`."""
        get = self.entries.get
        for e in entries:
            if e is not None and e.pins:
                e.pins -= 1
                if not e.pins:
                    self._unpinned(e, get(e.key) is e)

    def _unpinned(self, entry: Entry, live: bool) -> None:
        """`entry`'s last pin is gone: evictable if it is still held, else its slot is free."""
        if live:
            self._pinned.discard(entry.key)
        else:
            self._free.append(entry.slot)
            self._removed_pinned -= 1

    def remove(self, key: Hashable) -> Entry | None:
        """Forget `key`'s entry; its slot is free now, or once its last pin is released."""
        e = self.entries.pop(key, None)
        if e is not None:
            self._pinned.discard(key)
            self.policy.remove(key)
            if e.pins:
                self._removed_pinned += 1
            else:
                self._free.append(e.slot)
        return e

    def busy(self) -> int:
        """Entries currently pinned, removed ones included (0 when idle: the accounting check)."""
        return len(self._pinned) + self._removed_pinned
