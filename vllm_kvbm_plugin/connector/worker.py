"""KVBMConnector, worker side: the CPU pool, copies against vLLM's KV tensors, disk I/O.

Each tier entry is one contiguous pool slot: a block's bytes of every attention layer, one after
another (or, for hybrid models, the Mamba state of every state layer at one position), so a disk
file is a slot. Copies go through the transfer engine (tiers/transfer.py): on CPU done before the
hook returns, on CUDA asynchronous on a side stream, reported when their event has passed (a
store's disk and remote writes are queued only then: they read its slots). Disk writes run on a
background thread from slots the scheduler keeps pinned until the write is reported; disk reads
(prefetches) are verified before their bytes reach a slot.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import torch

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.layout import KV, EntryKind, Layout, TierDecision, tensor_fingerprint
from vllm_kvbm_plugin.connector.metadata import (
    DirectLoad,
    KVBMMetadata,
    KVBMWorkerMetadata,
    Op,
    Report,
    copy_count,
    copy_ops,
)
from vllm_kvbm_plugin.connector.stats import KVBMStats
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import disk as diskfmt
from vllm_kvbm_plugin.tiers import host_memory
from vllm_kvbm_plugin.tiers import remote as remotefmt
from vllm_kvbm_plugin.tiers.mac import mac_key
from vllm_kvbm_plugin.tiers.transfer import Layer, TransferEngine, slots_to_layer

logger = get_logger("connector.worker")


class WorkerSide:
    """KVBMConnector's worker side, one per worker process (tensor-parallel rank): owns this
    rank's CPU pool (the CPU tier's slots), its view of vLLM's KV tensors (`layers`), the disk
    writer thread, open block files of direct loads, the remote tier's connection (`RemoteIO`)
    and the transfer stats. KVBMConnector calls it each step: `start_load_kv` before the forward
    (disk opens and prefetches, remote fetches, loads: from CPU slots, direct from disk,
    position-independent), `wait_for_save` after it (stores into slots, disk and remote writes),
    `build_worker_meta` to report what finished to the scheduler side."""

    def __init__(self, layout: Layout, cfg: KVBMConfig, rank: int):
        self.layout, self.cfg, self.rank = layout, cfg, rank
        self.slot_bytes = layout.slot_bytes
        self.disk_base: str | None = None
        self._init_state()
        if layout.root is not None:  # a layout decided already (tests); an engine's worker follows the first step's
            self._open_tiers()

    def follow(self, decision: TierDecision) -> None:
        """Take the scheduler side's decision (the first step's metadata): the tier secret, the key
        root and whether the remote tier is on, then open the disk and remote tiers under it. A
        worker never reads the secret or probes the server itself, so all ranks agree with the
        scheduler side whatever each process saw at startup."""
        if self.layout.root is not None:
            if (decision.root, decision.secret) != (self.layout.root, self.layout.secret):
                raise RuntimeError(f"KVBMConnector worker {self.rank}: told {decision!r}, but it follows another "
                                   "decision already (the key root differs)")
            return
        self.layout = self.layout.following(decision)
        if self.described is not None:
            self.fingerprint = tensor_fingerprint(self.layout.root, self.described)
        self._open_tiers()
        logger.info("KVBMConnector worker %d follows the scheduler side: %r", self.rank, decision)

    def _open_tiers(self) -> None:
        """The disk tier's rank directory and the remote tier's connection, under the decided root
        and the MAC key of their files and values (tiers/mac.py), derived once from the secret."""
        self.mac_key = mac_key(self.layout.secret)
        self.disk_base = self.layout.rank_dir(self.rank)
        if self.disk_base is not None:
            try:  # 0700 whatever the umask; existing tier directories are tightened (logged)
                diskfmt.prepare_block_dir(self.layout.disk_path, self.disk_base)
            except OSError as e:
                self._disk_broken = True
                logger.warning("KVBMConnector: disk tier directory %s unusable (%s); no more disk writes",
                               self.disk_base, e)
        if self.cfg.remote_url and not self.layout.remote_off:
            self.remote = RemoteIO(self, self.cfg.remote_url)

    def _init_state(self) -> None:
        # kind -> per group of that kind, its layers (each with its offset inside a slot)
        self.layers: dict[EntryKind, list[list[Layer]]] = {}
        self.pool: torch.Tensor | None = None
        self.copies: TransferEngine | None = None
        self._jobs: dict = {}  # copy job -> (direction, blocks, stored keys, writes queued once done)
        self._last_store: int | None = None  # the newest store job still in flight
        self.reports: list[Report] = []
        self._disk_results: queue.SimpleQueue = queue.SimpleQueue()
        self._disk_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._disk_broken = False  # the tier directory was unusable at start: no disk writes at all
        self._disk_resume = 0.0  # monotonic time disk writes resume after failing as a whole
        self._disk_failed = False  # such a failure, not yet reported to the scheduler side
        self.held: dict = {}  # key -> open, verified block file (direct disk loads)
        self.load_errors: set = set()  # block ids of failed direct loads, for vLLM's failure policy
        self.recved: set = set()  # requests whose asynchronous loads ran (KVBMMetadata.recving)
        self.failed_recving: set = set()  # those of them with a failed load
        self._loads_failed = False  # a load of this step failed: its stores must not run (wait_for_save)
        self.stats = KVBMStats()
        self._stats_lock = threading.Lock()  # the disk writer thread records too
        self.peaks: dict[str, float] = {}  # "<tier>_<direction>" -> bytes/s (measure_roofline)
        self.remote: RemoteIO | None = None  # opened by _open_tiers when the decision says so
        self.mac_key = None  # of block files and remote values, once the decision is known (_open_tiers)
        self.described: list | None = None  # the KV layers' layout (register_kv_caches), for the fingerprint
        self.fingerprint: bytes | None = None  # of the exact byte layout of an entry, under the key root

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.layout.num_blocks
        described = []
        for kind, group_ids in self.layout.groups.items():
            offset, per_group = 0, []
            for g in group_ids:
                layers = []
                for name in self.layout.layer_names[g]:
                    try:  # blocks on dim 0 as vLLM lays its views out, never guessed from sizes
                        t = compat.block_major_view(kv_caches[name], num_blocks)
                    except ValueError as e:
                        raise ValueError(f"KVBMConnector: KV cache of {name}: {e}") from None
                    layer = Layer(t, 0)
                    layer.offset, offset = offset, offset + layer.nbytes
                    layers.append(layer)
                    described.append((name, layer.block_shape, str(t.dtype), layer.dim))
                per_group.append(layers)
            if offset > self.slot_bytes:
                raise ValueError(f"KVBMConnector: a {kind} entry needs {offset} bytes, slots have {self.slot_bytes}")
            self.layers[kind] = per_group
        self.described = described
        if self.layout.root is not None:
            self.fingerprint = tensor_fingerprint(self.layout.root, described)
        pin = torch.cuda.is_available()
        # CUDA: pinned with exactly the bytes asked, plus staging rows past the CPU tier's slots
        # for direct disk loads (WorkerSide.load_direct_staged)
        self.direct_rows = direct_staging_rows(self.slot_bytes) if pin else 0
        t0 = time.perf_counter()
        self.pool = host_memory.allocate(self.layout.cpu_slots + self.direct_rows, self.slot_bytes, pin)
        resident = pin or _make_resident(self.pool)  # pinned memory is resident already
        self.scratch = torch.empty((1, self.slot_bytes), dtype=torch.uint8)  # direct loads: verify, odd layouts
        self.copies = TransferEngine(self.layers, self.pool)
        n_layers = sum(len(ls) for gs in self.layers.values() for ls in gs)
        logger.info("KVBMConnector worker: %d layers, %d bytes per slot, CPU pool %d slots (%.1f MiB, %s in %.2f s)",
                    n_layers, self.slot_bytes, self.layout.cpu_slots, self.pool.numel() / 2**20,
                    "pinned" if pin else "resident" if resident else "faulted in on use", time.perf_counter() - t0)
        if self.cfg.measure_roofline:
            self._measure_roofline()

    def _measure_roofline(self) -> None:
        """This machine's peak per transfer kind (tiers/roofline.py), before any request: every stats
        interval then carries it, and the log line and a gauge show each tier's speed as a share."""
        from vllm_kvbm_plugin.tiers import roofline

        t0 = time.perf_counter()
        kv = next(layer.tensor for groups in self.layers.values() for layers in groups for layer in layers)
        n = min(kv.untyped_storage().nbytes(), self.pool.numel(), 256 << 20)
        kv_bytes = torch.empty(0, dtype=torch.uint8, device=kv.device).set_(kv.untyped_storage(), 0, (n,))
        peaks = roofline.copy_peaks(kv_bytes, self.pool.view(-1)[:n])
        try:  # before the scheduler side's decision: the disk_path's file system, the configured server
            if self.cfg.disk_path and os.path.isdir(self.cfg.disk_path):
                peaks.update(roofline.disk_peaks(self.cfg.disk_path))
            if self.cfg.remote_url:
                client = remotefmt.connect(self.cfg.remote_url)
                try:
                    peaks.update(roofline.remote_peaks(client, self.slot_bytes))
                finally:
                    client.close()  # the measurement's own connection; RemoteIO keeps its own
        except Exception as e:  # a tier that cannot be measured is left out, never fatal
            logger.warning("KVBMConnector: roofline measurement incomplete (%s)", e)
        self.peaks = roofline.per_direction(peaks)
        logger.info("KVBMConnector roofline (%.1f s): %s", time.perf_counter() - t0,
                    ", ".join(f"{d} {v / 2**30:.2f} GiB/s" for d, v in self.peaks.items()))

    # ---- copies ----------------------------------------------------------------------------
    def _copy(self, ops: list, to_pool: bool) -> None:
        """Copy (kind, block id per group, slot) ops and wait for them (tests, benchmarks)."""
        self.copies.submit(ops, to_pool)
        self.copies.wait()

    def _poll(self) -> None:
        """Settle the copy jobs finished since the last call: stats, store reports, and the writes
        that waited for their slots."""
        for job, seconds in self.copies.get_finished() if self.copies is not None else ():
            entry = self._jobs.pop(job, None)
            if entry is None:
                continue  # a _copy
            direction, blocks, batch, writes = entry
            self._record("cpu", direction, blocks, time.perf_counter() - seconds)
            if batch:
                self._report(Op.STORE, batch, True)
            for fn, args in writes:
                fn(*args)
            if job == self._last_store:
                self._last_store = None

    def _load_direct(self, kind: EntryKind, ids: tuple[int, ...], fd: int) -> bool:
        """Read an open entry file's payload straight into its blocks: a view of the block's page per
        layer, in slot order (layers without page views go through the scratch slot)."""
        scratch = self.scratch[0].numpy()
        parts, via_scratch, end = [], [], 0
        for gi, layers in enumerate(self.layers[kind]):
            for layer in layers:
                if layer.pages is not None:
                    w = layer.nbytes // 8
                    if not 0 <= ids[gi] < layer.pages.shape[0] // w:
                        raise IndexError(f"block id {ids[gi]} out of range")
                    parts.append(layer.pages[ids[gi] * w:(ids[gi] + 1) * w])
                else:
                    parts.append(scratch[layer.offset:layer.offset + layer.nbytes])
                    via_scratch.append((layer, ids[gi]))
                end = layer.offset + layer.nbytes
        parts.append(scratch[end:])  # the slot's unused tail (slots fit the larger entry kind)
        if not diskfmt.read_payload(fd, parts, self.mac_key):
            return False
        for layer, block_id in via_scratch:
            slots_to_layer(layer, [block_id], [0], self.scratch)
        return True

    def load_direct_staged(self, loads: list) -> None:
        """Direct disk loads through pinned staging (CUDA; the CPU path reads straight into the KV
        pages): each batch of held-open, verified files is read into the pool's staging rows and
        moved into its blocks by one load job, which the forward's stream waits for, instead of a
        pageable scratch slot copied layer by layer, block by block, each a synchronous copy. A batch
        reuses the rows once the previous load job has read them. A file that no longer reads back
        verified is a failed load, handled as on the CPU path (_direct_load_failed)."""
        first = self.layout.cpu_slots
        for at in range(0, len(loads), self.direct_rows):
            self.copies.wait_loads()  # the previous batch (this step's or the last) has left the rows
            ops = []
            for row, d in enumerate(loads[at:at + self.direct_rows], first):
                fd = self.held.get(d.key)
                if fd is not None and diskfmt.read_payload(fd, [self.pool[row].numpy()], self.mac_key):
                    ops.append((d.kind, d.block_ids, row))
                else:
                    self._direct_load_failed(d)
            if ops:
                self.copies.submit(ops, to_pool=False)

    # ---- connector hooks -------------------------------------------------------------------
    def _record(self, tier: str, direction: str, blocks: int, t0: float) -> None:
        with self._stats_lock:
            self.stats.record(tier, direction, blocks, blocks * self.slot_bytes, time.perf_counter() - t0)

    def _failed(self, operation: str) -> None:
        with self._stats_lock:
            self.stats.failure(operation)

    def _count(self, counters: dict) -> None:
        """Add named counters to the stats (position-independent loads report theirs here)."""
        with self._stats_lock:
            data = self.stats.data
            for name, v in counters.items():
                data[name] = data.get(name, 0) + v

    def get_stats(self) -> KVBMStats | None:
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, KVBMStats()
        stats.peaks(self.peaks)
        return stats

    def _report(self, op: Op, key, ok: bool) -> None:
        self.reports.append(Report(op, key, ok))

    def start_load_kv(self, meta: KVBMMetadata, forward_context=None) -> None:
        if meta.decision is not None:
            self.follow(meta.decision)
        elif self.layout.root is None:
            raise RuntimeError("KVBMConnector: a worker got work before the scheduler side's decision (the first "
                               "step's metadata carries it); vLLM delivered the steps out of order")
        self._loads_failed = False
        if meta.opens:  # verified and kept open for a direct load next step, all in one call
            t0 = time.perf_counter()
            keys = list(meta.opens)
            opened = diskfmt.open_verified_blocks(self._paths(keys), keys, self.fingerprint, self.mac_key,
                                                  self.slot_bytes)
            for key, o in zip(keys, opened):
                if o is not None:
                    old = self.held.pop(key, None)
                    if old is not None:
                        os.close(old)
                    self.held[key] = o[0]
                self._report(Op.OPEN, key, o is not None)
            self._disk_done("read", sum(o is not None for o in opened), len(keys), t0)
        if meta.prefetches or meta.remote_fetches:
            self.copies.wait_loads()  # slots a load still reads may be written now
        if meta.prefetches:  # read and verified straight into their (not yet ready) slots
            t0 = time.perf_counter()
            keys = [p.key for p in meta.prefetches]
            metas = diskfmt.read_blocks(self._paths(keys), keys, self.fingerprint, self.mac_key,
                                        [self.pool[p.slot].numpy() for p in meta.prefetches])
            for key, m in zip(keys, metas):
                self._report(Op.PREFETCH, key, m is not None)
            self._disk_done("read", sum(m is not None for m in metas), len(keys), t0)
        for f in meta.remote_fetches:
            self.remote.submit(("fetch", f.key, f.slot))
        if meta.loads:  # the forward waits for them (on CUDA its stream does, not the host)
            job = self.copies.submit(copy_ops(meta.loads), to_pool=False)
            self._jobs[job] = ("load", copy_count(meta.loads), 0, ())
            self._poll()
        if meta.direct_loads:
            t0 = time.perf_counter()
            if self.copies.cuda:  # through pinned staging rows, a load job per batch
                self.load_direct_staged(meta.direct_loads)
            else:
                for d in meta.direct_loads:
                    fd = self.held.get(d.key)
                    if fd is None or not self._load_direct(d.kind, d.block_ids, fd):
                        self._direct_load_failed(d)
            self._record("disk", "load", len(meta.direct_loads), t0)
        self.recved.update(meta.recving)
        if meta.pic_queries:  # the scheduler side split a request's query (patches/pic_segments.py)
            from vllm_kvbm_plugin.patches import pic_segments

            if not pic_segments.applied():
                raise RuntimeError("KVBMConnector: split queries sent to a model runner without the pic_segments patch")
        if meta.pic_loads:
            from vllm_kvbm_plugin.connector import pic_load

            pic_load.load(meta.pic_loads, self.cfg.pic_model, self.layout.block_size, self.layers[KV], self.pool,
                          self.cfg.pic_recompute_ratio, self._blocks_failed, self._count, forward_context)
        for key in meta.closes:
            fd = self.held.pop(key, None)
            if fd is not None:
                os.close(fd)

    def wait_for_save(self, meta: KVBMMetadata) -> None:
        if self._loads_failed:
            self._drop_saves(meta)
            return
        writes = [(self._submit_write, (w.key, w.slot, w.meta)) for w in meta.disk_writes]
        writes += [(self.remote.submit, (("write", w.key, w.slot, w.meta),)) for w in meta.remote_writes]
        if meta.stores:
            job = self.copies.submit(copy_ops(meta.stores), to_pool=True)
            self._jobs[job] = ("store", copy_count(meta.stores), meta.store_batch, [])
            self._last_store = job
        if self._last_store is not None:  # writes read slots stores fill: queued once they are done
            self._jobs[self._last_store][3].extend(writes)
        else:
            for fn, args in writes:
                fn(*args)
        self._poll()

    def _drop_saves(self, meta: KVBMMetadata) -> None:
        """A load of this step failed: its blocks hold whatever was in them, and the forward that
        just ran read them (any request that shares them too). vLLM recomputes from the failed
        block on, but nothing this step would store can be trusted, so none of it reaches a tier:
        the step's stores fail as one, and its disk and remote writes (they read the slots those
        stores fill) are not made. A miss, never a wrong block kept."""
        if meta.stores:
            self._report(Op.STORE, meta.store_batch, False)
        for w in meta.disk_writes:
            self._disk_results.put((w.key, False))
        for w in meta.remote_writes:
            self._report(Op.REMOTE_WRITE, w.key, False)
        n = copy_count(meta.stores) if meta.stores else 0
        if n or meta.disk_writes or meta.remote_writes:
            logger.warning("KVBMConnector: a load failed; this step's %d stores and %d writes are dropped",
                           n, len(meta.disk_writes) + len(meta.remote_writes))

    def build_worker_meta(self) -> KVBMWorkerMetadata | None:
        self._poll()
        while True:
            try:
                key, ok = self._disk_results.get_nowait()
            except queue.Empty:
                break
            self._report(Op.WRITE, key, ok)
        if self.remote is not None:
            self.reports += self.remote.take_reports()
        reports, self.reports = self.reports, []
        if not reports:
            return None
        failed, self._disk_failed = self._disk_failed, False
        return KVBMWorkerMetadata(reports, broken=("disk",) if self._disk_broken or failed else ())

    def _direct_load_failed(self, d: DirectLoad) -> None:
        """Verified a step ago and held open since: only a failing device, or someone changing the
        file in place meanwhile (read_payload checks the bytes again), gets here. vLLM then follows
        its kv_load_failure_policy (recompute, or fail the request). An asynchronous load (hybrid
        models: vLLM takes block-level errors for one KV cache group only) fails its request's
        load as a whole; its blocks are that waiting request's alone, nothing else read them. A
        synchronous one reports its blocks, and the step's stores are dropped (the forward read them)."""
        self._failed("read")
        if d.request is not None:
            self.failed_recving.add(d.request)
            logger.error("KVBMConnector: direct load of disk block %s failed; request %s recomputes",
                         diskfmt.key_hex(d.key), d.request)
            return
        self._loads_failed = True
        self.load_errors.update(d.block_ids)
        logger.error("KVBMConnector: direct load of disk block %s failed; reported to vLLM", diskfmt.key_hex(d.key))

    def take_recving(self) -> tuple[set, set]:
        """(requests whose asynchronous loads ran, those of them that failed) since the last call:
        vLLM's finished_recving and failed_recving (a failed one is both, as vLLM wants it)."""
        done, failed = self.recved, self.failed_recving
        self.recved, self.failed_recving = set(), set()
        return done, failed

    def _blocks_failed(self, ids) -> None:
        """Position-independent loads that failed: vLLM recomputes them; this step stores nothing."""
        self._loads_failed = True
        self.load_errors.update(ids)

    def take_load_errors(self) -> set:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # ---- disk ------------------------------------------------------------------------------
    def _paths(self, keys: list) -> list[str]:
        return [diskfmt.block_path(self.disk_base, k) for k in keys]

    def _disk_done(self, operation: str, ok: int, n: int, t0: float) -> None:
        """Stats of one batched disk call: `ok` of `n` blocks done, the rest failed."""
        if ok:
            self._record("disk", operation, ok, t0)
        for _ in range(n - ok):
            self._failed(operation)

    def _disk_writes_on(self) -> bool:
        return not self._disk_broken and time.monotonic() >= self._disk_resume

    def _submit_write(self, key, slot: int, blob: bytes) -> None:
        if not self._disk_writes_on():
            self._disk_results.put((key, False))
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kvbm-disk-writer", daemon=True)
            self._writer.start()
        self._disk_jobs.put((key, slot, blob))

    WRITE_BATCH = 32  # blocks per GIL-free write call (their reports wait for the whole batch)

    def _write_loop(self) -> None:
        _run_batches(self._disk_jobs, self.WRITE_BATCH, self._write_batch)

    def _write_batch(self, jobs: list) -> None:
        """Write block files from their slots (pinned by the scheduler until reported) in one call
        that holds no GIL. A name taken by something not ours fails that block alone; any other
        error (a full disk) pauses disk writes for WRITE_PAUSE_S, here and on the scheduler side."""
        ok = [False] * len(jobs)
        t0 = time.perf_counter()
        if self._disk_writes_on():
            keys = [key for key, _, _ in jobs]
            try:
                errors = diskfmt.write_blocks(self._paths(keys), keys, self.fingerprint, self.mac_key,
                                              [self.pool[slot].numpy() for _, slot, _ in jobs],
                                              [blob for _, _, blob in jobs], fsync=self.cfg.disk_fsync)
            except OSError as e:
                errors = [e] * len(jobs)
            for i, (key, e) in enumerate(zip(keys, errors)):
                if e is None:
                    ok[i] = True
                elif isinstance(e, diskfmt.BlockRefused):
                    logger.warning("KVBMConnector: disk block %s not stored (%s)", diskfmt.key_hex(key), e)
                elif self._disk_writes_on():
                    self._disk_resume = time.monotonic() + diskfmt.WRITE_PAUSE_S
                    self._disk_failed = True
                    logger.warning("KVBMConnector: disk tier write failed (%s); disk writes pause for %.0f s",
                                   e, diskfmt.WRITE_PAUSE_S)
        self._disk_done("write", sum(ok), len(jobs), t0)
        for (key, _, _), good in zip(jobs, ok):
            self._disk_results.put((key, good))

    def wait_for_disk(self, timeout: float = 30.0) -> None:
        """Block until copies, queued disk writes and remote operations are done (shutdown, tests)."""
        if self.copies is not None:
            self.copies.wait()
            self._poll()
        if self.remote is not None:
            self.remote.drain(timeout)
        if self._writer is not None:
            self._disk_jobs.put(None)
            self._writer.join(timeout)
            self._writer = None

    def shutdown(self) -> None:
        self.wait_for_disk()
        for fd in self.held.values():
            os.close(fd)
        self.held.clear()


_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def _make_resident(t: torch.Tensor) -> bool:
    """Fault in the pages of `t` now (madvise MADV_POPULATE_WRITE), as pinning does on GPUs.
    Otherwise the first disk reads and remote fetches into fresh slots pay a page fault per 4 KiB
    while a request waits: measured in a VM, 43 ms instead of 1.4 ms to read a 1856-token
    prompt's 58 blocks, and done in the background the faults slowed the first prompts' forward
    passes by up to 1.5x on 2 cores. Costs about 1.4 s per GiB at startup there. False where the
    kernel cannot (the pool then stays lazy)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    return end <= start or libc.madvise(start, end - start, _MADV_POPULATE_WRITE) == 0


def _run_batches(jobs: queue.SimpleQueue, limit: int, run) -> None:
    """run(batch) on what `jobs` holds, up to `limit` jobs at a time, until a None arrives."""
    while True:
        batch, job = [], jobs.get()
        while job is not None:
            batch.append(job)
            if len(batch) >= limit:
                break
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                break
        if batch:
            run(batch)
        if job is None:
            return


class RemoteIO:
    """The remote tier, worker side: one thread and one connection per worker. Fetches (verified
    into their not-yet-ready pool slots) and writes (from slots the scheduler keeps pinned until
    reported) are taken in batches, one pipelined round trip each; a value that does not verify
    is deleted. Every failure is a miss, reported like any other (the Breaker then spares the
    server for a while)."""

    BATCH = 64

    def __init__(self, side: WorkerSide, url: str):
        self.side, self.url = side, url
        self.prefix = remotefmt.key_prefix(side.layout.root, side.rank)
        self.breaker = remotefmt.Breaker(f"worker {side.rank}", url)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.client = None
        self.direct = remotefmt.DirectClient(url) if remotefmt.DirectClient.supports(url) else None
        self.failures = {"fetch": 0, "write": 0}  # misses and failed writes (connector stats name disk only)
        self._start()  # connects at once, in the background: the first fetch finds its connections open

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="kvbm-remote-io", daemon=True)
            self.thread.start()

    def submit(self, job: tuple) -> None:
        self._start()
        self.jobs.put(job)

    def take_reports(self) -> list[Report]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    def drain(self, timeout: float) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join(timeout)
            self.thread = None
            if self.direct is not None:
                self.direct.close()

    def _loop(self) -> None:
        if self.client is None and self.breaker.allow():
            try:
                self.client = remotefmt.connect_ready(self.url)
                if self.direct is not None:
                    self.direct.connect()
                self.breaker.success()
            except Exception as e:  # down at startup: a miss until the breaker lets a batch probe it
                self.breaker.failure(e)
        _run_batches(self.jobs, self.BATCH, self._run)

    def _run(self, batch: list) -> None:
        fetches = [j for j in batch if j[0] == "fetch"]
        writes = [j for j in batch if j[0] == "write"]
        done: dict = {}
        if self.breaker.allow():
            t0 = time.perf_counter()
            try:
                if self.client is None:
                    self.client = remotefmt.connect(self.url)
                done = self._fetch(fetches, t0) if fetches else {}
                t0 = time.perf_counter()
                if writes:
                    self._write(writes)
                    self.side._record("remote", "write", len(writes), t0)
                    done.update({("write", j[1]): True for j in writes})
                self.breaker.success()
            except Exception as e:  # down, slow, reset, paused, out of memory: a miss
                self.breaker.failure(e)
        for job in batch:
            ok = done.get((job[0], job[1]), False)
            if not ok:
                self.failures[job[0]] += 1
            self.results.put(Report(Op.REMOTE_FETCH if job[0] == "fetch" else Op.REMOTE_WRITE, job[1], ok))
        if fetches:
            remotefmt.LANDINGS.landed()  # a scheduler side in this process waiting for them goes on

    def _fetch(self, fetches: list, t0: float) -> dict:
        names = [self.prefix + diskfmt.key_hex(key) for _, key, _ in fetches]
        outs = [self.side.pool[slot].numpy() for _, _, slot in fetches]
        keys = [key for _, key, _ in fetches]
        # a DirectClient reads straight into the slots, verified as the bytes land
        results = remotefmt.fetch_values(self.direct or self.client, names, keys, self.side.fingerprint,
                                         self.side.mac_key, outs)
        done, bad = {}, []
        for key, name, r in zip(keys, names, results):
            if r == remotefmt.BAD:
                bad.append(name)
                logger.warning("KVBMConnector: remote value %s does not verify; deleted (a miss)",
                               diskfmt.key_hex(key))
            done[("fetch", key)] = r == remotefmt.OK
        if bad:
            remotefmt.delete_values(self.client, bad)
        n = sum(done.values())
        if n:
            self.side._record("remote", "read", n, t0)
        return done

    def _write(self, writes: list) -> None:
        pool, fp, mk = self.side.pool, self.side.fingerprint, self.side.mac_key
        names = [self.prefix + diskfmt.key_hex(key) for _, key, _, _ in writes]
        values = [remotefmt.value_parts(key, fp, mk, pool[slot].numpy(), meta) for _, key, slot, meta in writes]
        remotefmt.store_values(self.direct or self.client, names, values)


DIRECT_STAGING_BYTES = 64 << 20  # CUDA: pinned rows for direct disk loads, past the CPU tier's slots


def direct_staging_rows(slot_bytes: int) -> int:
    """Pool rows set aside on CUDA for direct disk loads: DIRECT_STAGING_BYTES' worth, 2 to 32."""
    return max(2, min(32, DIRECT_STAGING_BYTES // slot_bytes))

