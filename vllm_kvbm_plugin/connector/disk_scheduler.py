"""The disk tier, scheduler half (EngineCore process): block files under
`<disk_path>/<layout root>/r<rank>/`, one per entry and rank (tiers/disk.py), read and written by
its worker half (disk_worker.py). Besides its index (cpu_tier.TierManager) it owns the restart index, the
keys being read into CPU slots, the files the workers hold open for direct loads, and unlinking
what it evicts.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, cast

import msgspec
from vllm.distributed.kv_events import BlockStored

from vllm_kvbm_plugin.connector.block_events import Announce, Announcer, compact, renamed
from vllm_kvbm_plugin.connector.base import Key, SlotJobs, TierJob, TierJobs, TierOp, Verb
from vllm_kvbm_plugin.connector.tier_manager import TierManager
from vllm_kvbm_plugin.connector.layout import Layout, rank_dir, remove_v1_tier_dir
from vllm_kvbm_plugin.events.types import SPARSE_KINDS, storage_tier
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers.index import Entry
from vllm_kvbm_plugin.tiers.pinned import restore
from vllm_kvbm_plugin.tiers import block_dir, block_file

if TYPE_CHECKING:
    from vllm_kvbm_plugin.config import KVBMConfig

logger = get_logger("connector")

_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE_STORED = msgspec.msgpack.Decoder(BlockStored).decode


def _max_direct() -> int:
    """Disk entries held open per worker at once: a quarter of the file descriptor limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 8192 if soft == resource.RLIM_INFINITY else max(16, min(8192, soft // 4))


MAX_DIRECT = _max_direct()


@dataclasses.dataclass
class _Held:
    """A disk entry the workers verify and keep open for a direct load."""
    entry: Entry  # pinned while held
    ready: bool = False  # every worker verified it
    requests: set[str] = dataclasses.field(default_factory=set)  # the requests waiting for it


class DiskTier(SlotJobs, TierManager):
    """The disk tier (a base.SecondaryTier): block files under `<disk_path>/<layout root>/r<rank>/`,
    one per entry and rank. Built and called by SchedulerSide in the EngineCore process; the
    workers (worker.py) read, write, open and close the files it plans.

    Besides the index it owns the keys being read into CPU slots (`prefetching`), the files the
    workers hold open for direct loads (`held`), and the opens and closes the workers owe."""

    label = "disk"
    waits = False
    direct = True
    FETCH, OPEN = TierOp(label, Verb.FETCH), TierOp(label, Verb.OPEN)
    CLOSE, WRITE = TierOp(label, Verb.CLOSE), TierOp(label, Verb.WRITE)

    @classmethod
    def create(cls, layout: Layout, cfg: KVBMConfig) -> DiskTier | None:
        if not layout.disk_path:
            return None
        if layout.v1_root is not None:  # once per engine (the scheduler side), not in every worker process
            remove_v1_tier_dir(layout.disk_path, layout.v1_root)
        return cls(layout, cfg.eviction_policy)

    def __init__(self, layout: Layout, policy: str) -> None:
        if not layout.disk_path:
            raise ValueError("KVBMConnector: the disk tier needs disk_path")
        root = layout.decided_root()
        super().__init__(storage_tier(f"kvbm-disk:{root[0]:016x}{root[1]:016x}"),
                         layout.disk_slots, policy)
        self.path = layout.disk_path
        self.bases = [rank_dir(self.path, root, r) for r in range(layout.world)]
        self.meta_bytes = layout.disk_meta_bytes  # what a file's metadata may take (disk_slots counts it)
        self.oversized = 0  # entries not written: their metadata would take more
        self.writes_resume = 0.0  # monotonic time stores resume after a worker's disk failed
        self.prefetching: dict[Key, Entry] = {}  # key -> its entry, pinned while read into a CPU slot
        self.held: dict[Key, _Held] = {}
        self.opens: list[Key] = []  # to send with the next metadata
        self.closes: list[Key] = []
        self._load_index()

    # ---- the contract (base.SecondaryTier) -----------------------------------------------------
    def describe(self) -> str:
        return f"disk tier {self.index.capacity} slots under {self.path}"

    def prepare_lookup(self, req_id: str, keys: list[Key]) -> bool:
        return True  # its index answers at once

    def settle(self, op: TierOp, key: Key, ok: bool) -> None:
        if op.verb is Verb.FETCH:
            self.prefetched(key, ok)
        elif op.verb is Verb.OPEN:
            self.opened(key, ok)
        else:  # Verb.WRITE
            self.complete_store(key, ok)

    def on_request_finished(self, req_id: str) -> None:
        self.release(req_id)

    def on_schedule_end(self, meta: TierJobs) -> None:
        self.close_idle()
        meta.jobs += [TierJob(self.OPEN, key) for key in self.opens]
        meta.jobs += [TierJob(self.CLOSE, key) for key in self.closes]
        self.opens, self.closes = [], []

    def worker_failed(self) -> None:
        self.stop_writes()

    def accounting(self) -> dict[str, object]:
        return {self.label: {"blocks": len(self), "busy": self.busy()}, "prefetching": len(self.prefetching),
                "direct": len(self.held)}

    # ---- stores --------------------------------------------------------------------------
    def prepare_write(self, key: Key, parent: Key | None, end: int, announce: Announcer) -> bytes | None:
        """prepare_store for a write-through from a CPU slot: the file's metadata blob (where the
        entry ends and its events, announced again after a restart), or None."""
        if time.monotonic() < self.writes_resume or key in self or (parent is not None and parent not in self):
            return None
        if self.prepare_store(key, parent, announce) is None:
            return None
        announced = self.events_of(key)
        events = announced.events if announced is not None else ()
        blob = block_file.encode_meta(end, [_ENCODE(e) for e in events])
        if len(blob) > self.meta_bytes:  # the file would go beyond its share of disk_bytes_to_use
            self.complete_store(key, False)
            if not self.oversized:
                logger.warning("KVBMConnector: a disk block's metadata takes %d bytes, more than the %d each "
                               "file has room for (many extra keys?); such blocks are not written to disk",
                               len(blob), self.meta_bytes)
            self.oversized += 1
            return None
        return blob

    def stop_writes(self) -> None:
        """A worker's disk failed as a whole (unwritable, full): keep serving what the tier holds,
        store again after a pause (a full disk frees up)."""
        if time.monotonic() >= self.writes_resume:
            logger.warning("KVBMConnector: disk writes failed; the disk tier stops storing for %.0f s and "
                           "keeps serving what it holds", block_file.WRITE_PAUSE_S)
        self.writes_resume = time.monotonic() + block_file.WRITE_PAUSE_S

    # ---- loads: prefetches into CPU slots, and direct loads from open files --------------
    def prefetch(self, key: Key) -> None:
        self.prefetching[key] = self.prepare_load(key)

    def prefetched(self, key: Key, ok: bool) -> None:
        entry = self.prefetching.pop(key, None)
        self.complete_load(entry)
        if not ok and entry is not None and self.index.entries.get(key) is entry:
            self.lost(key)

    def busy_loading(self, key: Key) -> bool:
        """Whether `key` is still being verified by the workers (its request waits a step)."""
        h = self.held.get(key)
        return key in self.prefetching or (h is not None and not h.ready)

    def hold(self, key: Key, req_id: str) -> bool:
        """Ask the workers to verify `key` and keep its file open (if not asked yet) for `req_id`;
        False when MAX_DIRECT files are held already."""
        h = self.held.get(key)
        if h is None:
            if len(self.held) >= MAX_DIRECT:
                return False
            h = self.held[key] = _Held(self.prepare_load(key))
            self.opens.append(key)
        h.requests.add(req_id)
        return True

    def ready_direct(self, key: Key) -> bool:
        """Verified by every worker and held open: ready for a direct load."""
        h = self.held.get(key)
        return h is not None and h.ready

    def opened(self, key: Key, ok: bool) -> None:
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

    def _close(self, key: Key) -> None:
        h = self.held.pop(key, None)
        if h is not None:
            self.complete_load(h.entry)
            self.closes.append(key)

    def has_pending_work(self) -> bool:
        """Writes, prefetches or opens the workers have yet to report, and files to close (held
        open for requests that are gone: closed with the next step's metadata). Not the files
        held for a request that still waits for them, nor what the tier merely holds."""
        return bool(self.storing or self.prefetching or self.closes
                    or any(not h.ready or not h.requests for h in self.held.values()))

    def lost(self, key: Key) -> None:
        logger.warning("KVBMConnector: disk block %s is corrupt or missing; dropped (a miss)",
                       block_dir.key_hex(key))
        self.remove(key)

    # ---- files ---------------------------------------------------------------------------
    def _evicted(self, evicted: Sequence[tuple[Hashable, Entry | None]]) -> None:
        super()._evicted(evicted)
        for key, _ in evicted:
            self._unlink(cast(Key, key))  # the index holds this tier's keys

    def _unlink(self, key: Key) -> None:
        for base in self.bases:
            try:
                os.unlink(block_dir.block_path(base, key))
            except OSError:
                pass

    def _load_index(self) -> None:
        """Index the block files of earlier runs and announce them (parents first) from the
        BlockStored events each file carries in its metadata."""
        found = block_dir.scan(self.bases[0])
        readable, unreadable = [], 0
        for key, _size in found:
            meta = block_file.read_meta(block_dir.block_path(self.bases[0], key))
            if meta is None:  # unreadable, or another format version: it could never be a hit
                self._unlink(key)
                unreadable += 1
                continue
            info = block_file.decode_meta(meta)
            try:
                events = renamed([compact(_DECODE_STORED(ev)) for ev in info[1]], self.name) if info else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                events = None
            a = Announce(events, events[0].block_hashes[0]) if events and events[0].block_hashes else None
            readable.append((key, None, info[0] if info else 0, a))
        # more files than disk_bytes_to_use allows: the policy evicts some
        kept = [self.index.entries[k] for k in restore(self.index, readable, self._evicted)]
        described = [e for e in kept if e.meta is not None]
        held: set[tuple[int, object]] = set()
        for e in described:
            if all(ev.kv_cache_spec_kind in SPARSE_KINDS or ev.parent_block_hash is None
                   or (ev.group_idx, ev.parent_block_hash) in held for ev in e.meta.events):
                self._announce(e)
                held.update((ev.group_idx, e.meta.vhash) for ev in e.meta.events)
        if found:
            announced = sum(e.meta.announced for e in described)
            logger.info("KVBMConnector: disk tier holds %d entries from earlier runs (%d announced, %d "
                        "unreadable files removed)", len(self), announced, unreadable)
