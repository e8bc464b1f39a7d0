"""`TierManager`: the slot and entry bookkeeping every tier's scheduler side shares (EngineCore
process). The CPU tier is one (cpu_tier.py); the disk tier and the position-independent planner's
CPU tier build on it.

A manager owns one tier's index and eviction policy, its pins (entries being loaded or stored, and
the parent of an entry being stored, so a parent's BlockRemoved never precedes its child's
BlockStored) and its events, named in vLLM's vocabulary (medium, locality, ownership), in the
verbs of vLLM's OffloadingManager (vllm/v1/kv_offload/base.py): `lookup`, `touch`,
`prepare_load` / `complete_load`, `prepare_store` / `complete_store`, `take_events`. What to load
or store, and from where, is the planner's business (scheduler.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from vllm_kvbm_plugin.connector.base import Key, TierJobs, TierOp
from vllm_kvbm_plugin.connector.block_events import Announce, Announcer, renamed
from vllm_kvbm_plugin.events.types import Tier
from vllm_kvbm_plugin.tiers.index import Entry, TierIndex
from vllm_kvbm_plugin.tiers.pinned import PinnedStores
from vllm_kvbm_plugin.tiers.policies import make_policy


class TierManager:
    """One tier's entries by key (a TierIndex: slots, pins, eviction policy), the parents it
    pins, the children waiting for their parent's announcement, and its events. As the CPU tier
    it is SchedulerSide's primary (scheduler.py calls it; EngineCore process): the tier whose
    slots the workers copy to and from the KV cache, and the tier every other one loads into."""

    label = "cpu"

    def __init__(self, name: Tier, capacity: int, policy: str) -> None:
        self.name = name
        self.index = TierIndex(capacity, make_policy(policy))
        self.stores = PinnedStores(self.index)  # each store in flight pins its parent
        self.waiting: dict[Hashable, list[Hashable]] = {}  # key -> children stored before it was announced (announced after it)
        # keys prepared for a store whose outcome the workers owe -> the announcer of its events,
        # built when first needed (`events_of`: the store landed, or a child waits on it), not for
        # stores that fail
        self.storing: dict[Key, Announcer | None] = {}
        self.events: list[BlockStored | BlockRemoved] = []
        self.entries = self.index.entries  # key -> Entry (base.PrimaryTier; the same dict, never replaced)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: Key) -> bool:
        return key in self.index

    def lookup(self, key: Key) -> bool:
        """Whether `key` is stored and ready to load (hit planning asks this per hash unit)."""
        e = self.index.entries.get(key)
        return e is not None and e.ready

    def touch(self, key: Key) -> None:
        self.index.touch(key)

    def touch_all(self, keys: list[Key]) -> None:
        """touch() of each of `keys` in order."""
        self.index.touch_all(keys)

    def slot(self, key: Key) -> int:
        return self.index.entries[key].slot

    def events_of(self, key: Key) -> Announce | None:
        """The events of the entry of `key` (built now if its store has not landed yet)."""
        entry = self.index.entries[key]
        build = self.storing.get(key)
        if build is not None:
            entry.meta = build(self.name)
            self.storing[key] = None
        return entry.meta

    def announcement(self, key: Key) -> Announcer:
        """The events `key` was announced with here, renamed for another tier (its copy there)."""
        meta = self.events_of(key)

        def announce(name: Tier) -> Announce:
            if meta is None or not meta.events:
                return Announce(())
            return Announce(renamed(meta.events, name), meta.vhash)
        return announce

    def prepare_load(self, key: Key) -> Entry:
        """Protect the entry of `key` from eviction (and its slot from reuse) until complete_load
        of the entry returned."""
        return self.index.pin(key)

    def complete_load(self, entry: Entry | None) -> None:
        self.index.unpin(entry)

    def prepare_loads(self, keys: list[Key]) -> list[Entry]:
        """prepare_load() of each of `keys` (ready entries): a hit's entries in one call."""
        return self.index.pin_all(keys)

    def complete_loads(self, entries: list[Entry]) -> None:
        """complete_load() of each of `entries`."""
        self.index.unpin_all(entries)

    def prepare_store(self, key: Key, parent: Key | None, announce: Announcer) -> Entry | None:
        """A slot for `key` (pinned, not ready), evicting by the policy; None when the tier has no
        room. Its parent stays pinned until complete_store."""
        entry, evicted = self.stores.reserve(key, parent)
        if evicted:
            self._evicted(evicted)
        if entry is not None:
            self.storing[key] = announce
        return entry

    def prepare_stores(self, keys: list[Key], parent: Key | None, announcers: list[Announcer]) -> list[Entry]:
        """prepare_store of each of `keys` in turn (with its announcer), each under the key before
        it, the first under `parent`, while the tier has free slots: a request's run of new blocks
        in one call. Returns the entries made; the rest of `keys` need evictions (prepare_store)."""
        made = self.stores.reserve_chain(keys, parent)
        if made:
            self.storing.update(zip(keys[:len(made)], announcers))
        return made

    def complete_store(self, key: Key, ok: bool) -> None:
        """The bytes of `key` landed (announce it) or not (drop it); release its parent."""
        e, parent = self.stores.settle(key, ok)
        if e is not None:
            self.events_of(key)  # built from the announcer `storing` still holds
        self.storing.pop(key, None)
        if e is not None:
            self._announce_after(key, e, parent)
        elif not ok:
            self.waiting.pop(key, None)

    def complete_stores(self, keys: list[Key]) -> None:
        """complete_store(key, True) for each of `keys` in order: the step's landed stores, settled
        in one call (settling one never changes what the next one's announcement depends on)."""
        storing, name, entries, waiting, events = self.storing, self.name, self.index.entries, self.waiting, self.events
        for key, (e, parent) in zip(keys, self.stores.settle_landed(keys)):
            build = storing.pop(key, None)
            if e is None:
                continue
            if build is not None:  # as events_of
                e.meta = build(name)
            if parent is not None:  # the usual case first: the parent is announced (or never will be)
                p = entries.get(parent)
                pm = p.meta if p is not None else None
                if p is None or parent in storing or (pm is not None and pm.events and not pm.announced) or key in waiting:
                    self._announce_after(key, e, parent)
                    continue
            elif key in waiting:
                self._announce_after(key, e, parent)
                continue
            a = e.meta
            if a is not None and a.events and not a.announced:  # as _announce
                events += a.events
                a.announced = True

    def remove(self, key: Key) -> None:
        """`key` is gone (found corrupt or missing): drop it and announce the removal."""
        self.storing.pop(key, None)
        self._evicted([(key, self.index.remove(key))])

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        events, self.events = self.events, []
        return events

    def busy(self) -> int:
        return self.index.busy()

    def has_pending_work(self) -> bool:
        """Stores the workers have yet to report (see SchedulerSide.has_pending_push_work)."""
        return bool(self.storing)

    # ---- the rest of the contract (base.SchedulerTier) -----------------------------------------
    def settle(self, op: TierOp, key: Key, ok: bool) -> None:
        """A store into a slot of this tier: the workers' copies from the KV cache (Verb.STORE),
        or from another tier (Verb.FETCH, settled there first)."""
        self.complete_store(key, ok)

    def release(self, req_id: str) -> None:
        return  # loads pin their entries (prepare_load), the planner unpins them

    def on_request_finished(self, req_id: str) -> None:
        return

    def on_schedule_end(self, meta: TierJobs) -> None:
        return

    def worker_failed(self) -> None:
        return

    def accounting(self) -> dict[str, object]:
        return {self.label: {"blocks": len(self), "busy": self.busy()}}

    def take_stats(self) -> dict[str, int]:
        return {}  # what it moves, the workers count

    def _announce(self, entry: Entry) -> None:
        a = entry.meta
        if a is not None and a.events and not a.announced:
            self.events += a.events
            a.announced = True

    def _announce_after(self, key: Hashable, entry: Entry, parent: Hashable | None) -> None:
        """Announce `key` once its parent is announced here (a router drops a block whose parent
        it does not hold): now, after the parent, or never when the parent left unannounced
        (e.g. its bytes never came); the entry serves loads all the same."""
        if parent is not None:
            p = self.index.entries.get(parent)
            if p is None:
                return
            if parent in self.storing:  # its store has not landed: its events decide whether to wait
                self.events_of(parent)
            if p.meta is not None and p.meta.events and not p.meta.announced:
                self.waiting.setdefault(parent, []).append(key)
                return
        self._announce(entry)
        for child in self.waiting.pop(key, ()):
            c = self.index.ready(child)
            if c is not None:
                self._announce_after(child, c, None)

    def _evicted(self, evicted: Sequence[tuple[Hashable, Entry | None]]) -> None:
        """Entries that left the tier: announce their removals, one event per group."""
        by_group: dict[int, list] = {}
        for key, e in evicted:
            self.waiting.pop(key, None)
            if e is not None and e.meta is not None and e.meta.announced:
                for ev in e.meta.events:
                    by_group.setdefault(ev.group_idx, []).append(e.meta.vhash)
        for g, hashes in by_group.items():
            self.events.append(BlockRemoved(block_hashes=hashes, medium=self.name.medium, group_idx=g,
                                            locality=self.name.locality, ownership=self.name.ownership))
