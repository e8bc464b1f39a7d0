"""Our disk tier as a vLLM `SecondaryTierManager`, behind vLLM's CPU primary tier:

    "secondary_tiers": [{"type": "KVBMDiskTier", "module_path": "vllm_kvbm_plugin.offloading",
                         "path": DIR, "bytes_to_use": N}]

Optional keys: "eviction_policy" (lru | lineage | multi_lru, default lineage), "threads" (I/O
threads, default 8: creating a file is most of a write's cost and waits in the file system, so
several go at once; a job's files are spread over them), "direct_io" (default false: O_DIRECT
writes, which keep no second copy of stored chunks in the page cache, so reading them back comes
from the device), "fsync" (default false), "enable_kv_events" (default true; effective when the
engine publishes KV events).

The same block files as KVBMConnector's disk tier (tiers/block_file.py: with a MAC, written to a
temporary file and renamed into place, opened without following symlinks or blocking, verified
before a byte is used), under `<DIR>/<layout fingerprint>/r0/`; one file holds one primary-tier
chunk (every worker's pages of it). A load that fails verification (flipped, truncated, deleted,
foreign file) fails that key: vLLM drops the chunk it was read into and recomputes, and the tier
forgets the entry (a Removed event). Capacity: `bytes_to_use`, enforced by the same TierIndex and
eviction policies as our connector's tiers. Restart: the files of earlier runs are indexed (and
announced) at start. Events: Stored when a file is in place, Removed when it is evicted or found
bad, as medium STORAGE, locality LOCAL, ownership "kvbm-disk:<fingerprint>".

A file is named by the 128-bit digest of vLLM's OffloadKey and carries the OffloadKey, its parent
and end position in its MAC'd metadata (chunks.py), compared on every load and read back by
the restart index.

All vLLM calls run on the scheduler thread and stay cheap: the index, pins and events live there;
the pool threads only read and write files (and the primary tier's memory the job names), each
part of a job in one call that holds no GIL (tiers/fileio.py): an engine loop holding the GIL
delays a part once, not once per syscall.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import msgspec
import numpy as np
from vllm.v1.kv_offload.base import Locality, LookupResult, OffloadingSpec, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.offloading.chunks import ChunkMeta, ChunkTier, decode_meta, encode_meta, file_key
from vllm_kvbm_plugin.offloading.lineage import parent_in_request
from vllm_kvbm_plugin.tiers import block_dir, block_file
from vllm_kvbm_plugin.tiers.index import Entry, TierIndex
from vllm_kvbm_plugin.tiers.pinned import PinnedStores, restore
from vllm_kvbm_plugin.tiers.policies import make_policy
from vllm_kvbm_plugin.tiers.secret import tier_secret

logger = get_logger("offloading")

_PART = 4  # files: a smaller share of a job is not worth another pool task
WRITE_PAUSE = 10.0  # s without new stores after a failed write (full disk, read-only directory)
class KVBMDiskTier(ChunkTier):
    """Our disk tier under vLLM's tiering manager (module docstring): built by vLLM's
    SecondaryTierFactory in the EngineCore process; its index, pins and events live on the
    scheduler thread, its pool threads only read and write files."""

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str, path: str,
                 bytes_to_use: int, eviction_policy: str = "lineage", threads: int = 8,
                 fsync: bool = False, direct_io: bool = False, enable_kv_events: bool = True,
                 locality: str | None = None,
                 backpressure_detector: BackpressureDetector | None = None) -> None:
        self.root = os.path.abspath(path)
        super().__init__(offloading_spec, primary_kv_view, tier_type, "kvbm-disk", enable_kv_events,
                         tier_secret(None, self.root).key, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else Locality.LOCAL
        self.base = block_dir.block_dir(self.root, self.fingerprint, 0)
        file_bytes = block_file.file_footprint(self.chunk_bytes, 128)  # metadata: ~100 bytes
        self.index = TierIndex(max(0, int(bytes_to_use) // file_bytes), make_policy(eviction_policy))
        self.fsync, self.direct_io = bool(fsync), bool(direct_io)
        self.threads = max(1, int(threads))
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, "kvbm-disk-tier")
        self._stores = PinnedStores(self.index)  # each store in flight pins its parent
        self._writes_paused_until = 0.0
        self.failed_writes = self.failed_loads = 0
        try:
            block_dir.prepare_block_dir(self.root, self.base)
        except OSError as e:
            self._pause_writes(f"cannot prepare {self.base}: {e}")
        self._load_index()
        logger.info("KVBMDiskTier: %s, %d chunks of %d bytes at most (%s policy), %d held from earlier runs",
                    self.base, self.index.capacity, self.chunk_bytes, eviction_policy, len(self.index))

    # ---- vLLM's SecondaryTierManager verbs (scheduler thread) --------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.index.ready(key) is not None else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            if key in self.index:
                self.index.touch(key)

    def submit_store(self, job: TransferJob) -> None:
        work = []
        if time.monotonic() >= self._writes_paused_until:
            for key, chunk in zip(job.keys, job.chunk_ids):
                parent = parent_in_request(key, job.req_context)
                parent = parent if parent in self.index else None
                if key in self.index:
                    continue
                entry, evicted = self._stores.reserve(key, parent)
                self._evicted(evicted)
                if entry is None:
                    continue
                pos = job.req_context.get_offload_key_position(key) or 0
                work.append((key, int(chunk), encode_meta(ChunkMeta(key, parent, pos))))
        self._jobs[job.job_id] = (self._spread(self._write, work), False, work)

    def submit_load(self, job: TransferJob) -> None:
        work, pinned = [], []
        for key, chunk in zip(job.keys, job.chunk_ids):
            if self.index.ready(key) is not None:
                pinned.append(self.index.pin(key))
                work.append((key, int(chunk)))
        self._jobs[job.job_id] = (self._spread(self._read, work), True, (list(job.keys), pinned))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id, futures, is_load, keys in self._finished():
            try:
                parts = [f.result() for f in futures]
                ok_keys, seconds = set().union(*(ok for ok, _ in parts)), max(t for _, t in parts)
            except Exception:  # a bug, never a file's content: the keys fail, the step goes on
                logger.exception("KVBMDiskTier: I/O job %d failed", job_id)
                ok_keys, seconds = set(), None
            results.append(self._finish_load(job_id, keys, ok_keys, seconds) if is_load
                           else self._finish_store(job_id, keys, ok_keys, seconds))
        return results

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._rows = np.empty((0, 0), np.uint8)  # vLLM closes the primary tier's mmap next: no view of it may remain

    # ---- completions (scheduler thread) -------------------------------------------------------
    def _finish_store(self, job_id: int, work: list[tuple[OffloadKey, int, bytes]], ok_keys: set[OffloadKey],
                      seconds: float | None) -> JobResult:
        stored = []
        for key, _, _ in work:
            if self._stores.settle(key, key in ok_keys)[0] is not None:
                stored.append(key)
        if len(ok_keys) < len(work):
            self.failed_writes += len(work) - len(ok_keys)
            self._pause_writes(f"{len(work) - len(ok_keys)} of {len(work)} chunk writes failed")
        self._event(stored, removed=False)
        return JobResult(job_id, success=len(ok_keys) == len(work), transfer_time=seconds,
                         transfer_bytes=len(ok_keys) * self.chunk_bytes)

    def _finish_load(self, job_id: int, keys: tuple[list[OffloadKey], list[Entry]], ok_keys: set[OffloadKey],
                     seconds: float | None) -> JobResult:
        job_keys, pinned = keys
        self.index.unpin_all(pinned)
        bad = [e.key for e in pinned if e.key not in ok_keys and self.index.entries.get(e.key) is e]
        if bad:
            self.failed_loads += len(bad)
            logger.warning("KVBMDiskTier: %d chunk file(s) corrupt, truncated or missing: dropped (misses)",
                           len(bad))
            self._evicted([(k, self.index.remove(k)) for k in bad])
        ok = [k for k in job_keys if k in ok_keys]
        return JobResult(job_id, success=len(ok) == len(job_keys),
                         successful_keys=tuple(ok) if ok and len(ok) < len(job_keys) else None,
                         transfer_time=seconds, transfer_bytes=len(ok) * self.chunk_bytes)

    def _evicted(self, evicted: list, announce: bool = True) -> None:
        """Entries that left the tier: their files go, their removal is announced."""
        gone = []
        for key, entry in evicted:
            self._unlink(key)
            if entry is not None and entry.ready:
                gone.append(key)
        if announce:
            self._event(gone, removed=True)

    def _pause_writes(self, why: str) -> None:
        self._writes_paused_until = time.monotonic() + WRITE_PAUSE
        logger.warning("KVBMDiskTier: %s; no new stores for %.0f s (the tier keeps serving what it holds)",
                       why, WRITE_PAUSE)

    def _unlink(self, key: bytes) -> None:
        try:
            os.unlink(block_dir.block_path(self.base, file_key(key)))
        except OSError:
            pass

    def _spread(self, fn: Callable[[list[Any]], tuple[set[OffloadKey], float]],
                work: list[Any]) -> list[concurrent.futures.Future[tuple[set[OffloadKey], float]]]:
        """fn over `work` on the pool, in up to `threads` parts of at least _PART files (a part
        per thread lets a job's file creations and reads wait in the file system side by side)."""
        n = max(1, min(self.threads, len(work) // _PART))
        return [self._pool.submit(fn, work[i::n]) for i in range(n)]

    # ---- file I/O (pool threads) -----------------------------------------------------------
    def _write(self, work: list) -> tuple[set, float]:
        """One part of a store job: its files in one call that holds no GIL (tiers/block_file.py write_blocks)."""
        t0 = time.perf_counter()
        fkeys = [file_key(key) for key, _, _ in work]
        errors = block_file.write_blocks([block_dir.block_path(self.base, k) for k in fkeys], fkeys, self.fingerprint,
                                      self.mac_key,
                                      [self._rows[chunk] for _, chunk, _ in work], [meta for _, _, meta in work],
                                      fsync=self.fsync, direct=self.direct_io)
        for e in errors:
            if e is not None:
                logger.debug("KVBMDiskTier: write failed: %s", e)
        return {key for (key, _, _), e in zip(work, errors) if e is None}, time.perf_counter() - t0

    def _read(self, work: list) -> tuple[set, float]:
        """One part of a load job: its files read and verified in one call that holds no GIL."""
        t0, ok = time.perf_counter(), set()
        fkeys = [file_key(key) for key, _ in work]
        metas = block_file.read_blocks([block_dir.block_path(self.base, k) for k in fkeys], fkeys, self.fingerprint,
                                    self.mac_key,
                                    [self._rows[chunk] for _, chunk in work])
        for (key, _), meta in zip(work, metas):
            try:
                if meta is not None and decode_meta(meta).key == key:
                    ok.add(key)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        return ok, time.perf_counter() - t0

    # ---- restart -------------------------------------------------------------------------------
    def _load_index(self) -> None:
        """Index the chunk files of earlier runs, parents before children, and announce them.
        Files that are not chunk files of this format are removed (they could never be a hit);
        everything else in the directory is left alone (tiers/block_dir.py scan)."""
        found, removed = [], 0
        for fkey, _size in block_dir.scan(self.base):
            path = block_dir.block_path(self.base, fkey)
            try:
                meta = decode_meta(block_file.read_meta(path) or b"")
            except (msgspec.DecodeError, msgspec.ValidationError):
                meta = None
            if meta is None or file_key(meta.key) != fkey:
                try:
                    os.unlink(path)
                except OSError:
                    pass
                removed += 1
                continue
            found.append(meta)
        # more files than bytes_to_use allows: the policy evicts some, unannounced
        kept = restore(self.index, [(m.key, m.parent, m.end, None) for m in found],
                       lambda evicted: self._evicted(evicted, announce=False))
        self._event(kept, removed=False)
        if removed:
            logger.info("KVBMDiskTier: removed %d unreadable chunk files under %s", removed, self.base)
