"""Scheduler-side tier managers in the verbs of vLLM's OffloadingManager (vllm/v1/kv_offload/base.py):
`lookup`, `touch`, `prepare_load` / `complete_load`, `prepare_store` / `complete_store`, `take_events`.

A manager owns one tier's index and eviction policy, its pins (entries being loaded or stored, and
the parent of an entry being stored, so a parent's BlockRemoved never precedes its child's
BlockStored) and its events, named in vLLM's vocabulary (medium, locality, ownership). The disk
tier adds its files: the restart index, the files held open for direct loads, unlinking what it
evicts. What to load or store, and from where, is the planner's business (scheduler.py).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import resource
import threading
import time
from collections.abc import Callable
import msgspec

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from vllm_kvbm_plugin.connector.layout import Layout
from vllm_kvbm_plugin.events.types import LOCALITY_REMOTE, TIER_CPU, Tier, storage_tier
from vllm_kvbm_plugin.events.validator import SPARSE_KINDS
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import disk as diskfmt
from vllm_kvbm_plugin.tiers.index import Entry, TierIndex
from vllm_kvbm_plugin.tiers.policies import make_policy
from vllm_kvbm_plugin.tiers import remote as remotefmt
from vllm_kvbm_plugin.tiers.secret import REMOTE_NAME as SECRET_NAME
from vllm_kvbm_plugin.tiers.secret import tier_secret

logger = get_logger("connector")

_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE_STORED = msgspec.msgpack.Decoder(BlockStored).decode


class Announce(msgspec.Struct, gc=False):
    """The BlockStored events of one tier entry (one per group), published once its bytes are in
    place; no events: an internal entry, never announced. Kept as long as the entry, so like the
    entry untracked by the garbage collector, with events whose fields are tuples (`compact`)."""
    events: tuple
    vhash: object = None  # vLLM's event hash of the entry, for BlockRemoved
    announced: bool = False


def compact(event: BlockStored) -> BlockStored:
    """An event to keep with a tier entry: its lists as tuples, which (holding only atoms) the
    garbage collector stops tracking, where a list stays tracked, and walked, for good."""
    extra = event.extra_keys
    return msgspec.structs.replace(event, block_hashes=tuple(event.block_hashes), token_ids=tuple(event.token_ids),
                                   extra_keys=None if extra is None else tuple(extra))


Announcer = Callable[[Tier], Announce]  # the events of an entry, named for a tier


def _renamed(events, name: Tier) -> tuple:
    return tuple(msgspec.structs.replace(ev, medium=name.medium, locality=name.locality, ownership=name.ownership)
                 for ev in events)


class TierManager:
    def __init__(self, name: Tier, capacity: int, policy: str):
        self.name = name
        self.index = TierIndex(capacity, make_policy(policy))
        self.parent_pins: dict = {}  # key -> its parent, pinned until the key is stored or dropped
        self.waiting: dict = {}  # key -> children stored before it was announced (announced after it)
        self.storing: set = set()  # keys prepared for a store whose outcome the workers owe
        self.events: list = []

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key) -> bool:
        return key in self.index

    def lookup(self, key) -> bool:
        """Whether `key` is stored and ready to load."""
        return self.index.ready(key) is not None

    def touch(self, key) -> None:
        self.index.touch(key)

    def slot(self, key) -> int:
        return self.index.entries[key].slot

    def announcement(self, key) -> Announcer:
        """The events `key` was announced with here, renamed for another tier (its copy there)."""
        meta = self.index.entries[key].meta

        def announce(name: Tier) -> Announce:
            if meta is None or not meta.events:
                return Announce(())
            return Announce(_renamed(meta.events, name), meta.vhash)
        return announce

    def prepare_load(self, key) -> Entry:
        """Protect a ready entry from eviction until complete_load."""
        self.index.pin(key)
        return self.index.entries[key]

    def complete_load(self, key) -> None:
        self.index.unpin(key)

    def prepare_store(self, key, parent, announce: Announcer) -> Entry | None:
        """A slot for `key` (pinned, not ready), evicting by the policy; None when the tier has no
        room. Its parent stays pinned until complete_store."""
        if parent is not None:
            self.index.pin(parent)
        entry, evicted = self.index.reserve(key, parent, announce(self.name))
        self._evicted(evicted)
        if entry is None:
            if parent is not None:
                self.index.unpin(parent)
            return None
        self.storing.add(key)
        if parent is not None:
            self.parent_pins[key] = parent
        return entry

    def complete_store(self, key, ok: bool) -> None:
        """The bytes of `key` landed (announce it) or not (drop it); release its parent."""
        self.storing.discard(key)
        parent = self.parent_pins.pop(key, None)
        if parent is not None:
            self.index.unpin(parent)
        if ok:
            e = self.index.complete(key)
            if e is not None:
                self._announce_after(key, e, parent)
        else:
            self.index.remove(key)
            self.waiting.pop(key, None)

    def remove(self, key) -> None:
        """`key` is gone (found corrupt or missing): drop it and announce the removal."""
        self.storing.discard(key)
        self._evicted([(key, self.index.remove(key))])

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events

    def busy(self) -> int:
        return self.index.busy()

    def has_pending_work(self) -> bool:
        """Stores the workers have yet to report (see SchedulerSide.has_pending_push_work)."""
        return bool(self.storing)

    def _announce(self, entry: Entry) -> None:
        a = entry.meta
        if a is not None and a.events and not a.announced:
            self.events += a.events
            a.announced = True

    def _announce_after(self, key, entry: Entry, parent) -> None:
        """Announce `key` once its parent is announced here (a router drops a block whose parent
        it does not hold): now, after the parent, or never when the parent left unannounced
        (e.g. its bytes never came); the entry serves loads all the same."""
        if parent is not None:
            p = self.index.entries.get(parent)
            if p is None:
                return
            if p.meta is not None and p.meta.events and not p.meta.announced:
                self.waiting.setdefault(parent, []).append(key)
                return
        self._announce(entry)
        for child in self.waiting.pop(key, ()):
            c = self.index.ready(child)
            if c is not None:
                self._announce_after(child, c, None)

    def _evicted(self, evicted: list) -> None:
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


def cpu_tier(layout: Layout, policy: str) -> TierManager:
    return TierManager(TIER_CPU, layout.cpu_slots, policy)


def _max_direct() -> int:
    """Disk entries held open per worker at once: a quarter of the file descriptor limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 8192 if soft == resource.RLIM_INFINITY else max(16, min(8192, soft // 4))


MAX_DIRECT = _max_direct()


@dataclasses.dataclass
class _Held:
    """A disk entry the workers verify and keep open for a direct load."""
    ready: bool = False  # every worker verified it
    requests: set = dataclasses.field(default_factory=set)  # the requests waiting for it


class DiskTier(TierManager):
    """The disk tier: block files under `<disk_path>/<layout root>/r<rank>/`, one per entry and rank.

    Besides the index it owns the keys being read into CPU slots (`prefetching`), the files the
    workers hold open for direct loads (`held`), and the opens and closes the workers owe."""

    def __init__(self, layout: Layout, policy: str):
        root_hex = f"{layout.root[0]:016x}{layout.root[1]:016x}"
        super().__init__(storage_tier(f"kvbm-disk:{root_hex}"),
                         layout.disk_slots, policy)
        self.bases = [layout.rank_dir(r) for r in range(layout.world)]
        self.writes_on = True
        self.prefetching: set = set()
        self.held: dict = {}  # key -> _Held
        self.opens: list = []  # to send with the next metadata
        self.closes: list = []
        self._load_index()

    # ---- stores --------------------------------------------------------------------------
    def prepare_write(self, key, parent, end: int, announce: Announcer) -> bytes | None:
        """prepare_store for a write-through from a CPU slot: the file's metadata blob (where the
        entry ends and its events, announced again after a restart), or None."""
        if not self.writes_on or key in self or (parent is not None and parent not in self):
            return None
        if self.prepare_store(key, parent, announce) is None:
            return None
        events = self.index.entries[key].meta.events
        return diskfmt.encode_meta(end, [_ENCODE(e) for e in events])

    def stop_writes(self) -> None:
        """A worker's disk failed as a whole (unwritable, full): keep serving what the tier holds."""
        if self.writes_on:
            self.writes_on = False
            logger.warning("KVBMConnector: disk writes failed; the disk tier stops storing and keeps "
                           "serving what it holds")

    # ---- loads: prefetches into CPU slots, and direct loads from open files --------------
    def prefetch(self, key) -> None:
        self.prepare_load(key)
        self.prefetching.add(key)

    def prefetched(self, key, ok: bool) -> None:
        self.prefetching.discard(key)
        self.complete_load(key)
        if not ok:
            self.lost(key)

    def busy_loading(self, key) -> bool:
        """Whether `key` is still being verified by the workers (its request waits a step)."""
        h = self.held.get(key)
        return key in self.prefetching or (h is not None and not h.ready)

    def hold(self, key, req_id: str) -> bool:
        """Ask the workers to verify `key` and keep its file open (if not asked yet) for `req_id`;
        False when MAX_DIRECT files are held already."""
        h = self.held.get(key)
        if h is None:
            if len(self.held) >= MAX_DIRECT:
                return False
            h = self.held[key] = _Held()
            self.prepare_load(key)
            self.opens.append(key)
        h.requests.add(req_id)
        return True

    def open_and_ready(self, key) -> bool:
        """Verified by every worker and held open: ready for a direct load."""
        h = self.held.get(key)
        return h is not None and h.ready

    def opened(self, key, ok: bool) -> None:
        if ok:
            if key in self.held:
                self.held[key].ready = True
        else:
            self._close(key)  # on the workers that did open it
            self.lost(key)

    def release(self, req_id: str) -> None:
        """`req_id` no longer waits for the files it held (loaded, or not needed any more)."""
        for h in self.held.values():
            h.requests.discard(req_id)

    def close_idle(self) -> None:
        """Close the verified files no request waits for. Once per step, after every load of the
        step was planned (the workers read before they close), so a file is never closed and
        opened again in one step."""
        for k in [k for k, h in self.held.items() if h.ready and not h.requests]:
            self._close(k)

    def _close(self, key) -> None:
        if self.held.pop(key, None) is not None:
            self.complete_load(key)
            self.closes.append(key)

    def has_pending_work(self) -> bool:
        """Writes, prefetches or opens the workers have yet to report, and files to close (held
        open for requests that are gone: closed with the next step's metadata). Not the files
        held for a request that still waits for them, nor what the tier merely holds."""
        return bool(self.storing or self.prefetching or self.closes
                    or any(not h.ready or not h.requests for h in self.held.values()))

    def take_file_ops(self) -> tuple[list, list]:
        """(opens, closes) for this step's metadata."""
        ops = self.opens, self.closes
        self.opens, self.closes = [], []
        return ops

    def lost(self, key) -> None:
        logger.warning("KVBMConnector: disk block %s is corrupt or missing; dropped (a miss)",
                       diskfmt.key_hex(key))
        self.remove(key)

    # ---- files ---------------------------------------------------------------------------
    def _evicted(self, evicted: list) -> None:
        super()._evicted(evicted)
        for key, _ in evicted:
            self._unlink(key)

    def _unlink(self, key) -> None:
        for base in self.bases:
            try:
                os.unlink(diskfmt.block_path(base, key))
            except OSError:
                pass

    def _load_index(self) -> None:
        """Index the block files of earlier runs and announce them (parents first) from the
        BlockStored events each file carries in its metadata."""
        found = diskfmt.scan(self.bases[0])
        described, unreadable = [], 0
        for key, _size in found:
            meta = diskfmt.read_meta(diskfmt.block_path(self.bases[0], key))
            if meta is None:  # unreadable, or another format version: it could never be a hit
                self._unlink(key)
                unreadable += 1
                continue
            e, evicted = self.index.reserve(key)
            self._evicted(evicted)  # more files than disk_bytes_to_use allows
            if e is None:
                continue
            self.index.complete(key)
            info = diskfmt.decode_meta(meta)
            try:
                events = _renamed([compact(_DECODE_STORED(ev)) for ev in info[1]], self.name) if info else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                events = None
            if events and events[0].block_hashes:
                e.meta = Announce(events, events[0].block_hashes[0])
                described.append((info[0], e))
        held = set()
        for _, e in sorted(described, key=lambda d: d[0]):
            if all(ev.kv_cache_spec_kind in SPARSE_KINDS or ev.parent_block_hash is None
                   or (ev.group_idx, ev.parent_block_hash) in held for ev in e.meta.events):
                self._announce(e)
                held.update((ev.group_idx, e.meta.vhash) for ev in e.meta.events)
        if found:
            announced = sum(e.meta.announced for _, e in described)
            logger.info("KVBMConnector: disk tier holds %d entries from earlier runs (%d announced, %d "
                        "unreadable files removed)", len(self), announced, unreadable)


@dataclasses.dataclass
class _Lookup:
    asked: float
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    found: list = dataclasses.field(default_factory=list)  # set by the lookup thread before `done`
    merged: bool = False


class RemoteTier:
    """The shared remote tier (Redis / Valkey), scheduler side. The server holds the entries and
    evicts any of them whenever it likes, so this side keeps no index: it knows the keys a lookup
    or one of its own writes found recently (`present`), the fetches and writes in flight, and
    what it announced. Lookups run on a thread; a scheduler step waits for answers at most
    `budget` seconds in all, a request at most LOOKUP_PATIENCE (it waits steps meanwhile), and
    a lookup that takes longer, or a server that failed (Breaker), is a miss.

    Events: every value's metadata carries the entry's events (STORAGE, REMOTE, ownership = the
    tier's id), which `vllm-kvbm announce` publishes once per tier (events/announcer.py). With
    `announce` (remote_events "instance") this instance also announces the entries it wrote, and
    the removal of those it later finds missing or corrupt; evictions by the server are not seen
    here then."""

    PRESENT_TTL = 10.0  # s: a key seen present is trusted that long without asking again
    LOOKUP_PATIENCE = 0.2  # s: a request waits (steps) that long for its lookup, then it is a miss
    MAX_ANNOUNCED = 1 << 20  # announced keys remembered (for removals)
    FETCH_YIELD = 0.004  # s: a step's pause while a request waits for its fetches (see busy_loading)
    CONNECT_WAIT = 0.5  # s: startup waits that long at most for the connections (then they go on behind)
    SECRET_KEEP = 10.0  # s: a lookup writes the store's block-key secret back at most that often

    def __init__(self, layout: Layout, url: str, budget_ms: float, announce: bool = True):
        self.announce = announce
        root_hex = f"{layout.root[0]:016x}{layout.root[1]:016x}"
        self.name = storage_tier(f"kvbm-remote:{root_hex}", LOCALITY_REMOTE)
        self.url = url
        self.prefixes = [remotefmt.key_prefix(layout.root, r) for r in range(layout.world)]
        self.budget = budget_ms / 1000
        self.budget_left = self.budget
        self.breaker = remotefmt.Breaker("scheduler", url)
        secret = tier_secret(url, layout.disk_path)
        # A secret kept in the store is written back (SET NX) with lookups: the server may evict
        # it like any key, and an instance starting then would make a new one and share nothing.
        self.secret_hex = secret.key.hex() if secret.source == "remote" else None
        self.secret_kept = float("-inf")  # when it was last written back
        self.present: dict = {}  # key -> when it was seen present
        self.fetching: set = set()
        self.landed_seen = 0  # remotefmt.LANDINGS.count when last looked at
        self.writing: dict = {}  # key -> (Announce, parent)
        self.announced: collections.OrderedDict = collections.OrderedDict()  # key -> Announce
        self.lookups: dict = {}  # request id -> _Lookup
        self.events: list = []
        self.counters: collections.Counter = collections.Counter()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._client = None
        self._connected = threading.Event()  # set when the first connection attempt ended
        self._start_thread()
        self._connected.wait(self.CONNECT_WAIT)

    def __len__(self) -> int:
        return len(self.present)

    def names(self, key) -> list[str]:
        h = diskfmt.key_hex(key)
        return [p + h for p in self.prefixes]

    def busy(self) -> int:
        return len(self.fetching) + len(self.writing)

    def has_pending_work(self) -> bool:
        """Fetches or writes behind the workers have yet to report."""
        return bool(self.fetching or self.writing)

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, key) -> bool:
        """Seen present (every rank's value) within PRESENT_TTL."""
        t = self.present.get(key)
        return t is not None and time.monotonic() - t < self.PRESENT_TTL

    def ask(self, req_id: str, keys: list) -> bool:
        """Look `keys` up for `req_id` (once per request); True once answered (`lookup` then
        knows), False while the request should wait a step. A failed server answers at once."""
        lk = self.lookups.get(req_id)
        if lk is None:
            lk = self.lookups[req_id] = _Lookup(time.monotonic())
            keys = [k for k in keys if not self.lookup(k)]
            if not keys or not self.breaker.allow_soon():
                lk.done.set()
            else:
                self._submit(lk, keys)
        if not lk.done.is_set() and self.budget_left > 0:
            t0 = time.perf_counter()
            lk.done.wait(self.budget_left)
            self.budget_left -= time.perf_counter() - t0
        if lk.done.is_set():
            if not lk.merged:
                lk.merged = True
                now = time.monotonic()
                for k in lk.found:
                    self.present[k] = now
            return True
        if time.monotonic() - lk.asked < self.LOOKUP_PATIENCE:
            return False
        self.counters["lookup_timeouts"] += 1
        lk.merged = True  # a miss: the request goes on without the remote tier
        lk.done.set()
        return True

    def new_step(self) -> None:
        self.budget_left = self.budget
        if len(self.present) > 4 * self.MAX_ANNOUNCED:
            now = time.monotonic()
            self.present = {k: t for k, t in self.present.items() if now - t < self.PRESENT_TTL}

    def forget(self, req_id: str) -> None:
        self.lookups.pop(req_id, None)

    def _submit(self, lk: _Lookup, keys: list) -> None:
        self._start_thread()
        self._jobs.put((lk, keys))

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._lookup_loop, name="kvbm-remote-lookups", daemon=True)
            self._thread.start()

    def _connect(self) -> None:
        """Open the connection before the first lookup needs it; a server down is a miss. Lookups
        go over a DirectReader where one can (`call`: a few times faster than redis-py)."""
        try:
            if self._client is None and self.breaker.allow():
                self._client = remotefmt.connect_direct(self.url)
                self.breaker.success()
        except Exception as e:  # the breaker logs it; lookups are misses until it is back
            self.breaker.failure(e)
        finally:
            self._connected.set()

    def _lookup_loop(self) -> None:
        self._connect()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            lk, keys = job
            try:
                if self.breaker.allow():
                    lk.found = self._exists(keys)
                    self.breaker.success()
                    self.counters["lookups"] += 1
                    self.counters["lookup_keys"] += len(keys)
                    self.counters["lookup_keys_found"] += len(lk.found)
            except Exception as e:  # anything the client raises is a miss
                self.breaker.failure(e)
                self.counters["lookup_failures"] += 1
            lk.done.set()

    def _exists(self, keys: list) -> list:
        """The keys whose value every rank holds, in one pipelined round trip."""
        # one key per command: a cluster routes each to its node
        commands = [("EXISTS", name) for k in keys for name in self.names(k)]
        keep = self.secret_hex is not None and time.monotonic() - self.secret_kept > self.SECRET_KEEP
        if keep:
            commands.append(("SET", SECRET_NAME, self.secret_hex, "NX"))
        if self._client is None:
            self._client = remotefmt.connect_direct(self.url)
        found = remotefmt.run(self._client, commands)
        n = len(self.prefixes)
        for r in found[: len(keys) * n]:
            if isinstance(r, Exception):
                raise r
        if keep and not isinstance(found[-1], Exception):  # refused (a full server): again next time
            self.secret_kept = time.monotonic()
        return [k for i, k in enumerate(keys) if all(found[i * n : (i + 1) * n])]

    # ---- fetches into CPU slots ------------------------------------------------------------
    def prefetch(self, key) -> None:
        if not self.fetching:
            self.landed_seen = remotefmt.LANDINGS.count  # what landed before this fetch was asked
        self.fetching.add(key)

    def busy_loading(self, key) -> bool:
        """Being fetched. Then the request waits a step, and this step waits for up to
        FETCH_YIELD of its budget for a fetch to land (remotefmt.Landings: the request then goes
        on at once where the workers share this process). The pause also yields the CPU: an idle
        engine polls waiting requests in a tight loop that would keep the GIL and a core from the
        threads doing the fetch (a GIL convoy)."""
        if key not in self.fetching:
            return False
        if self.budget_left > 0:
            t0 = time.perf_counter()
            seen = remotefmt.LANDINGS.wait(self.landed_seen, min(self.budget_left, self.FETCH_YIELD))
            self.budget_left -= time.perf_counter() - t0
            if seen != self.landed_seen:
                self.landed_seen = seen
                self.budget_left = 0  # its report comes with this step's worker output: no more waiting
        return True

    def prefetched(self, key, ok: bool) -> None:
        self.fetching.discard(key)
        self.counters["fetched" if ok else "fetch_misses"] += 1
        if not ok:
            self.lost(key)

    def lost(self, key) -> None:
        """`key` is missing or did not verify (the worker deleted it): forget it, announce its removal."""
        self.present.pop(key, None)
        a = self.announced.pop(key, None)
        if a is not None:
            for ev in a.events:
                self.events.append(BlockRemoved(block_hashes=[a.vhash], medium=self.name.medium,
                                                group_idx=ev.group_idx, locality=self.name.locality,
                                                ownership=self.name.ownership))

    # ---- writes behind -----------------------------------------------------------------------
    def prepare_write(self, key, parent, end: int, announce: Announcer) -> bytes | None:
        """The value's metadata blob when `key` should be written now, else None (known present,
        being written, or the server failed lately)."""
        if key in self.writing or self.lookup(key) or not self.breaker.allow_soon():
            return None
        a = announce(self.name)
        self.writing[key] = (a, parent)
        return diskfmt.encode_meta(end, [_ENCODE(e) for e in a.events])

    def complete_store(self, key, ok: bool) -> None:
        a, parent = self.writing.pop(key, (None, None))
        self.counters["written" if ok else "write_failures"] += 1
        if not ok:
            return
        self.present[key] = time.monotonic()
        # announced only with its parent, as the other tiers are (a router needs the chain)
        if (self.announce and a is not None and a.events and key not in self.announced
                and (parent is None or parent in self.announced)):
            self.events += a.events
            a.announced = True
            self.announced[key] = a
            if len(self.announced) > self.MAX_ANNOUNCED:
                self.announced.popitem(last=False)  # its removal will never be announced by us

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(2 * remotefmt.SOCKET_TIMEOUT + 1)
            self._thread = None
