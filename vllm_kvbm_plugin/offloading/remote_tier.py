"""Our remote tier (Redis / Valkey) as a vLLM `SecondaryTierManager`, behind vLLM's CPU primary tier:

    "secondary_tiers": [{"type": "KVBMRemoteTier", "module_path": "vllm_kvbm_plugin.offloading",
                         "url": "redis://HOST:PORT/0"}]

`url` takes what KVBMConnector's `remote_url` takes (redis://, rediss://, unix://, redis+cluster://);
optional "enable_kv_events" (default true). One value per primary-tier chunk, named
`kvbm:<format>:<layout fingerprint>:r0:<file key>` with KVBMDiskTier's file key (a 128-bit digest
of vLLM's OffloadKey); the value is a block file's bytes (tiers/block_file.py), verified on every read:
a value that is missing, damaged, truncated, without a valid MAC or of another layout fails that key (vLLM recomputes
the chunk) and a bad one is deleted. The server's `maxmemory` policy bounds the tier (docs/remote.md);
this side keeps no index. vLLM offers a chunk again each time it re-enters the CPU tier (after an
eviction); a chunk this instance wrote or found there before is first asked for (EXISTS) and
written only if the server lost it, so it is not sent again while the server holds it.

Nothing waits for the server on the scheduler thread: lookups are vLLM's AsyncLookupManager (one
pipelined EXISTS per request and step, on its thread; RETRY meanwhile), loads and stores run on
one I/O thread each. Failure is a miss: a Breaker (tiers/breaker.py) per thread stops asking a
server that is down, slow or paused, and hits resume when it is back.

Events (with the engine's KV events on): Stored when a write is first acknowledged, unless the
server held the value already (another instance wrote and announced it: a router's remote index is
one for all instances); Removed when a load finds a value this instance announced gone, or finds a
value bad and deletes it, whoever wrote it; as medium STORAGE, locality REMOTE, ownership
"kvbm-remote:<fingerprint>". The server's own evictions are not seen from here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np
from vllm.v1.kv_offload.base import Locality, LookupResult, OffloadingSpec, OffloadKey, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from vllm_kvbm_plugin.log import get_logger, redact_url
from vllm_kvbm_plugin.offloading.chunks import ChunkMeta, ChunkTier, encode_meta, file_key
from vllm_kvbm_plugin.offloading.lineage import parent_in_request
from vllm_kvbm_plugin.tiers import block_dir, remote_value, resp
from vllm_kvbm_plugin.tiers.breaker import Breaker
from vllm_kvbm_plugin.tiers.secret import tier_secret

logger = get_logger("offloading")


T = TypeVar("T")


class _Exists(AsyncLookupManager):
    """The tier's lookups: vLLM's AsyncLookupManager batching them onto its thread, one pipelined
    EXISTS per batch through the tier's lookup breaker."""

    def __init__(self, tier: KVBMRemoteTier):
        self.tier = tier
        self.client: resp.Client | None = None
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list, req_context: ReqContext) -> Iterable[bool]:
        t = self.tier
        if t.off or not t.breakers["lookup"].allow():
            return [False] * len(keys)
        try:
            if self.client is None:
                self.client = resp.connect_direct(t.url)
            found = resp.run(self.client, [("EXISTS", t.name(k)) for k in keys])
            for r in found:
                if isinstance(r, Exception):
                    raise r
            t.breakers["lookup"].success()
            return [bool(r) for r in found]
        except Exception as e:  # the breaker logs it: misses until the server is back
            t.breakers["lookup"].failure(e)
            return [False] * len(keys)


def _remember(keys: collections.OrderedDict[OffloadKey, bool], key: OffloadKey, limit: int) -> None:
    """Add `key` (as the newest), forgetting the oldest beyond `limit`."""
    keys[key] = True
    keys.move_to_end(key)
    while len(keys) > limit:
        keys.popitem(last=False)


class KVBMRemoteTier(ChunkTier):
    """Our remote tier under vLLM's tiering manager (module docstring): built by vLLM's
    SecondaryTierFactory in the EngineCore process, called on its scheduler thread; one I/O
    thread per direction and a lookup thread talk to the server."""

    MAX_ANNOUNCED = 1 << 20  # announced keys remembered (for their removals)

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str, url: str,
                 enable_kv_events: bool = True, backpressure_detector: BackpressureDetector | None = None) -> None:
        resp.check_url(url)
        secret = tier_secret(url, None)
        super().__init__(offloading_spec, primary_kv_view, tier_type, "kvbm-remote", enable_kv_events,
                         secret.key, backpressure_detector)
        self.url = url
        self.off = secret.remote_off  # the store's secret could not be read: every key a miss (logged)
        self.locality = Locality.REMOTE
        root = (int.from_bytes(self.fingerprint[:8], "big"), int.from_bytes(self.fingerprint[8:], "big"))
        self.prefix = remote_value.key_prefix(root, 0)
        self.breakers = {side: Breaker(f"offloading {side}", url) for side in ("lookup", "load", "store")}
        self._io = {op: concurrent.futures.ThreadPoolExecutor(1, f"kvbm-remote-{op}") for op in ("load", "store")}
        self._clients: dict[str, Any] = {}  # "load" / "store" -> the client its thread uses
        # keys this instance announced: Stored once each, Removed only for those (a value another
        # instance wrote is announced in that instance's stream)
        self._announced: collections.OrderedDict[OffloadKey, bool] = collections.OrderedDict()
        self.failed_writes = self.failed_loads = 0
        self._lookups = _Exists(self)
        logger.info("KVBMRemoteTier: %s, chunks of %d bytes under %s*", redact_url(url), self.chunk_bytes,
                    self.prefix)

    # ---- the server --------------------------------------------------------------------------
    def name(self, key: bytes) -> str:
        return self.prefix + block_dir.key_hex(file_key(key))

    # ---- vLLM's SecondaryTierManager verbs (scheduler thread) --------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def submit_store(self, job: TransferJob) -> None:
        work = []
        for key, chunk in zip(job.keys, job.chunk_ids):
            parent = parent_in_request(key, job.req_context)
            pos = job.req_context.get_offload_key_position(key) or 0
            work.append((key, int(chunk), encode_meta(ChunkMeta(key, parent, pos))))
        self._jobs[job.job_id] = ([self._io["store"].submit(self._write, work)], False, work)

    def submit_load(self, job: TransferJob) -> None:
        work = [(key, int(chunk)) for key, chunk in zip(job.keys, job.chunk_ids)]
        self._jobs[job.job_id] = ([self._io["load"].submit(self._read, work)], True, work)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id, (future,), is_load, work in self._finished():
            try:
                ok, other, seconds = future.result()  # other: a load's lost keys, a store's existing ones
            except Exception:  # a bug, never the server's answer: the keys fail, the step goes on
                logger.exception("KVBMRemoteTier: I/O job %d failed", job_id)
                ok, other, seconds = set(), {}, None
            keys = [w[0] for w in work]
            done = [k for k in keys if k in ok]
            if is_load:
                self.failed_loads += len(keys) - len(done)
                if other:
                    self._lookups.mark_miss(other)
                    # announced here and gone, or bad and deleted here (whoever announced it)
                    self._event([k for k, bad in other.items() if self._announced.pop(k, False) or bad], removed=True)
                results.append(JobResult(job_id, success=len(done) == len(keys),
                                         successful_keys=tuple(done) if done and len(done) < len(keys) else None,
                                         transfer_time=seconds, transfer_bytes=len(done) * self.chunk_bytes))
            else:
                self.failed_writes += len(keys) - len(done)
                fresh = [k for k in done if k not in self._announced and k not in other]
                for k in fresh:  # one forgotten here will never have its removal announced by us
                    _remember(self._announced, k, self.MAX_ANNOUNCED)
                self._event(fresh, removed=False)
                results.append(JobResult(job_id, success=len(done) == len(keys), transfer_time=seconds,
                                         transfer_bytes=len(done) * self.chunk_bytes))
        return results

    def shutdown(self) -> None:
        self._lookups.shutdown()
        for pool in self._io.values():
            pool.shutdown(wait=True)
        self._rows = np.empty((0, 0), np.uint8)  # vLLM closes the primary tier's mmap next: no view of it may remain

    # ---- I/O (one thread per direction) -------------------------------------------------------
    def _call(self, op: str, fn: Callable[[Any], T]) -> T | None:
        """fn(client) on `op`'s connection, through its breaker; None when the server failed."""
        breaker = self.breakers[op]
        if self.off or not breaker.allow():
            return None
        try:
            if op not in self._clients:
                self._clients[op] = resp.connect_direct(self.url)
            out = fn(self._clients[op])
            breaker.success()
            return out
        except Exception as e:  # the breaker logs it: misses until the server is back
            breaker.failure(e)
            return None

    def _write(self, work: list) -> tuple[set, set, float]:
        """(keys written or held, those the server already held, seconds). Every key is asked for
        first (one round trip, no value): one held already (written here before, or by another
        instance) is neither written again nor announced; the rest go in one pipelined SET (from
        the slot's rows, not joined, on a redis:// or unix:// server)."""
        t0 = time.perf_counter()

        def write(client: Any) -> set[OffloadKey]:
            names = [self.name(w[0]) for w in work]
            held = {w[0] for w, r in zip(work, resp.run(client, [("EXISTS", n) for n in names])) if r == 1}
            missing = [(w, n) for w, n in zip(work, names) if w[0] not in held]
            resp.store_values(client, [n for _, n in missing], [
                remote_value.value_parts(file_key(key), self.fingerprint, self.mac_key, self._rows[chunk], meta)
                for (key, chunk, meta), _ in missing])
            return held

        held = self._call("store", write) if work else set()
        if held is None:  # the server failed (the breaker logs it): nothing written
            return set(), set(), time.perf_counter() - t0
        return {w[0] for w in work}, held, time.perf_counter() - t0

    def _read(self, work: list) -> tuple[set, dict, float]:
        t0 = time.perf_counter()
        names = [self.name(key) for key, _ in work]
        fkeys = [file_key(key) for key, _ in work]
        outs = [self._rows[chunk] for _, chunk in work]

        outcomes = self._call("load", lambda c: resp.fetch_values(c, names, fkeys, self.fingerprint,
                                                                        self.mac_key, outs))
        if outcomes is None:
            return set(), {}, time.perf_counter() - t0
        bad = [n for n, o in zip(names, outcomes) if o == remote_value.BAD]
        if bad:
            logger.warning("KVBMRemoteTier: %d value(s) damaged, truncated or of another layout: deleted (misses)",
                           len(bad))
            self._call("store", lambda c: resp.delete_values(c, bad))  # a multi-key DEL fails on a cluster
        ok = {key for (key, _), o in zip(work, outcomes) if o == remote_value.OK}
        lost = {key: o == remote_value.BAD for (key, _), o in zip(work, outcomes) if key not in ok}
        return ok, lost, time.perf_counter() - t0
