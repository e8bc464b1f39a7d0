"""KVBMConnector, worker side: the CPU pool, copies against vLLM's KV tensors, disk I/O.

Each tier entry is one contiguous pool slot: a block's bytes of every attention layer, one after
another (or, for hybrid models, the Mamba state of every state layer at one position), so a disk
file is a slot. Copies are batched per layer over all entries of a step: numba page copies for
vLLM's CPU layout, index_select / index_copy_ otherwise. Disk writes run on a background thread
from slots the scheduler keeps pinned until the write is reported; disk reads (prefetches) are
verified before their bytes reach a slot.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import numpy as np
import torch

from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.layout import EntryKind, Layout, tensor_fingerprint
from vllm_kvbm_plugin.connector.metadata import KVBMMetadata, KVBMWorkerMetadata, Load, Op, Report
from vllm_kvbm_plugin.connector.stats import KVBMStats
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import disk as diskfmt
from vllm_kvbm_plugin.tiers import remote as remotefmt
from vllm_kvbm_plugin.tiers.copy import copy_pages

logger = get_logger("connector.worker")


class _Layer:
    __slots__ = ("tensor", "dim", "offset", "nbytes", "block_shape", "pages")

    def __init__(self, tensor: torch.Tensor, dim: int):
        self.tensor, self.dim, self.offset = tensor, dim, 0
        shape = list(tensor.shape)
        del shape[dim]
        self.block_shape = tuple(shape)
        self.nbytes = tensor[(slice(None),) * dim + (0,)].numel() * tensor.element_size()
        # CPU tensors with blocks on dim 0 (vLLM's CPU layout): whole pages as uint64 words, copied
        # by the numba kernels without temporaries. A page can be longer than the block's data
        # (Mamba state views are padded to the attention page): the padding belongs to the same
        # block, so copying it is harmless.
        self.pages = None
        page = tensor.stride(0) * tensor.element_size() if tensor.dim() else 0
        start = tensor.storage_offset() * tensor.element_size()
        n = tensor.shape[0] if tensor.dim() else 0
        if (tensor.device.type == "cpu" and dim == 0 and page >= self.nbytes and page % 8 == 0
                and start % 8 == 0 and start + n * page <= tensor.untyped_storage().nbytes()):
            flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage(), start, (n * page,))
            self.pages = flat.numpy().view(np.uint64)
            self.nbytes = page


class WorkerSide:
    def __init__(self, layout: Layout, cfg: KVBMConfig, rank: int):
        self.layout, self.cfg, self.rank = layout, cfg, rank
        self.slot_bytes = layout.slot_bytes
        self.disk_base = layout.rank_dir(rank)
        self._init_state()
        if self.disk_base is not None:
            try:  # 0700 whatever the umask; existing tier directories are tightened (logged)
                diskfmt.prepare_block_dir(layout.disk_path, self.disk_base)
            except OSError as e:
                self._disk_broken = True
                logger.warning("KVBMConnector: disk tier directory %s unusable (%s); no more disk writes",
                               self.disk_base, e)

    def _init_state(self) -> None:
        # kind -> per group of that kind, its layers (each with its offset inside a slot)
        self.layers: dict[EntryKind, list[list[_Layer]]] = {}
        self.pool: torch.Tensor | None = None
        self.reports: list[Report] = []
        self._disk_results: queue.SimpleQueue = queue.SimpleQueue()
        self._disk_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._disk_broken = False
        self.held: dict = {}  # key -> open, verified block file (direct disk loads)
        self.load_errors: set = set()  # block ids of failed direct loads, for vLLM's failure policy
        self.stats = KVBMStats()
        self._stats_lock = threading.Lock()  # the disk writer thread records too
        remote_on = self.cfg.remote_url and not self.layout.remote_off  # as the scheduler side decided
        self.remote = RemoteIO(self, self.cfg.remote_url) if remote_on else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.layout.num_blocks
        described = []
        for kind, group_ids in self.layout.groups.items():
            offset, per_group = 0, []
            for g in group_ids:
                layers = []
                for name in self.layout.layer_names[g]:
                    t = kv_caches[name]
                    dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
                    if not dims:
                        raise ValueError(f"KVBMConnector: cannot find the block dimension of {name} {tuple(t.shape)}")
                    layer = _Layer(t, dims[0])
                    layer.offset, offset = offset, offset + layer.nbytes
                    layers.append(layer)
                    described.append((name, layer.block_shape, str(t.dtype), layer.dim))
                per_group.append(layers)
            if offset > self.slot_bytes:
                raise ValueError(f"KVBMConnector: a {kind} entry needs {offset} bytes, slots have {self.slot_bytes}")
            self.layers[kind] = per_group
        self.fingerprint = tensor_fingerprint(self.layout.root, described)
        pin = torch.cuda.is_available()
        self.pool = torch.empty((self.layout.cpu_slots, self.slot_bytes), dtype=torch.uint8, pin_memory=pin)
        t0 = time.perf_counter()
        resident = pin or _make_resident(self.pool)  # pinned memory is resident already
        self.scratch = torch.empty((1, self.slot_bytes), dtype=torch.uint8)  # direct loads: verify, odd layouts
        self._pool_words = self.pool.numpy().reshape(-1).view(np.uint64)
        n_layers = sum(len(ls) for gs in self.layers.values() for ls in gs)
        logger.info("KVBMConnector worker: %d layers, %d bytes per slot, CPU pool %d slots (%.1f MiB, %s in %.2f s)",
                    n_layers, self.slot_bytes, self.layout.cpu_slots, self.pool.numel() / 2**20,
                    "pinned" if pin else "resident" if resident else "faulted in on use", time.perf_counter() - t0)

    # ---- copies ----------------------------------------------------------------------------
    def _copy(self, ops: list[Load], to_pool: bool) -> None:
        """Run (kind, block id per group, slot) copies, batched per kind, group and layer. Page copies
        (vLLM's CPU layout) are collected and run together, split over threads; torch copies stay on
        this thread (torch ops from a helper thread would start a second OpenMP team)."""
        by_kind: dict[str, list] = {}
        for kind, ids, slot in ops:
            by_kind.setdefault(kind, []).append((ids, slot))
        jobs = []
        for kind, items in by_kind.items():
            slots = [s for _, s in items]
            sl = np.asarray(slots, np.int64)
            for gi, layers in enumerate(self.layers[kind]):
                block_ids = [ids[gi] for ids, _ in items]
                ids = np.asarray(block_ids, np.int64)
                for layer in layers:
                    if layer.pages is not None:
                        jobs.append((layer.pages, layer.nbytes // 8, layer.offset // 8, ids, sl))
                    elif to_pool:
                        self._layer_to_slots(layer, block_ids, slots)
                    else:
                        self._slots_to_layer(layer, block_ids, slots)
        copy_pages(jobs, self._pool_words, self.slot_bytes // 8, to_pool)

    def _layer_to_slots(self, layer: _Layer, block_ids: list[int], slots: list[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long, device=layer.tensor.device)
        data = layer.tensor.index_select(layer.dim, ids).movedim(layer.dim, 0)
        data = data.reshape(len(block_ids), -1).view(torch.uint8).cpu()
        self.pool[torch.tensor(slots, dtype=torch.long), layer.offset : layer.offset + layer.nbytes] = data

    def _slots_to_layer(self, layer: _Layer, block_ids: list[int], slots: list[int], pool=None) -> None:
        t = layer.tensor
        pool = self.pool if pool is None else pool
        data = pool[torch.tensor(slots, dtype=torch.long), layer.offset : layer.offset + layer.nbytes]
        data = data.view(t.dtype).reshape(len(block_ids), *layer.block_shape).to(t.device, non_blocking=True)
        t.index_copy_(layer.dim, torch.tensor(block_ids, dtype=torch.long, device=t.device),
                      data.movedim(0, layer.dim))

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
        if not diskfmt.read_payload(fd, parts):
            return False
        for layer, block_id in via_scratch:
            self._slots_to_layer(layer, [block_id], [0], self.scratch)
        return True

    # ---- connector hooks -------------------------------------------------------------------
    def _record(self, tier: str, direction: str, blocks: int, t0: float) -> None:
        with self._stats_lock:
            self.stats.record(tier, direction, blocks, blocks * self.slot_bytes, time.perf_counter() - t0)

    def _failed(self, operation: str) -> None:
        with self._stats_lock:
            self.stats.failure(operation)

    def get_stats(self) -> KVBMStats | None:
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, KVBMStats()
            return stats

    def _report(self, op: Op, key, ok: bool) -> None:
        self.reports.append(Report(op, key, ok))

    def start_load_kv(self, meta: KVBMMetadata) -> None:
        if meta.opens:  # verified and kept open for a direct load next step, all in one call
            t0 = time.perf_counter()
            keys = list(meta.opens)
            opened = diskfmt.open_verified_blocks(self._paths(keys), keys, self.fingerprint, self.slot_bytes)
            for key, o in zip(keys, opened):
                if o is not None:
                    old = self.held.pop(key, None)
                    if old is not None:
                        os.close(old)
                    self.held[key] = o[0]
                self._report(Op.OPEN, key, o is not None)
            self._disk_done("read", sum(o is not None for o in opened), len(keys), t0)
        if meta.prefetches:  # read and verified straight into their (not yet ready) slots
            t0 = time.perf_counter()
            keys = [p.key for p in meta.prefetches]
            metas = diskfmt.read_blocks(self._paths(keys), keys, self.fingerprint,
                                        [self.pool[p.slot].numpy() for p in meta.prefetches])
            for key, m in zip(keys, metas):
                self._report(Op.PREFETCH, key, m is not None)
            self._disk_done("read", sum(m is not None for m in metas), len(keys), t0)
        for f in meta.remote_fetches:
            self.remote.submit(("fetch", f.key, f.slot))
        if meta.loads:
            t0 = time.perf_counter()
            self._copy(meta.loads, to_pool=False)
            self._record("cpu", "load", len(meta.loads), t0)
        if meta.direct_loads:
            t0 = time.perf_counter()
            for d in meta.direct_loads:
                fd = self.held.get(d.key)
                if fd is None or not self._load_direct(d.kind, d.block_ids, fd):
                    self._direct_load_failed(d.key, d.block_ids)
            self._record("disk", "load", len(meta.direct_loads), t0)
        if meta.pic_loads:
            from vllm_kvbm_plugin.connector import pic

            pic.load(self, meta.pic_loads)
        for key in meta.closes:
            fd = self.held.pop(key, None)
            if fd is not None:
                os.close(fd)

    def wait_for_save(self, meta: KVBMMetadata) -> None:
        if meta.stores:
            t0 = time.perf_counter()
            self._copy([Load(s.kind, s.block_ids, s.slot) for s in meta.stores], to_pool=True)
            self._record("cpu", "store", len(meta.stores), t0)
            for s in meta.stores:
                self._report(Op.STORE, s.key, True)
        for w in meta.disk_writes:
            self._submit_write(w.key, w.slot, w.meta)
        for w in meta.remote_writes:
            self.remote.submit(("write", w.key, w.slot, w.meta))

    def build_worker_meta(self) -> KVBMWorkerMetadata | None:
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
        return KVBMWorkerMetadata(reports, broken=("disk",) if self._disk_broken else ())

    def _direct_load_failed(self, key, ids: tuple[int, ...]) -> None:
        """Verified a step ago and held open since: only a failing device gets here. vLLM takes
        block-level load errors for one KV cache group only (its kv_load_failure_policy: recompute
        them, or fail the request); with several groups it would stop the engine, so then the
        error is only logged."""
        self._failed("read")
        if len(self.layout.layer_names) == 1:
            self.load_errors.update(ids)
            logger.error("KVBMConnector: direct load of disk block %s failed; reported to vLLM",
                         diskfmt.key_hex(key))
        else:
            logger.error("KVBMConnector: direct load of disk block %s failed; the request that loads "
                         "it may produce wrong tokens", diskfmt.key_hex(key))

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

    def _submit_write(self, key, slot: int, blob: bytes) -> None:
        if self._disk_broken:
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
        error ends disk writes for good (the scheduler then stops asking)."""
        ok = [False] * len(jobs)
        t0 = time.perf_counter()
        if not self._disk_broken:
            keys = [key for key, _, _ in jobs]
            try:
                errors = diskfmt.write_blocks(self._paths(keys), keys, self.fingerprint,
                                              [self.pool[slot].numpy() for _, slot, _ in jobs],
                                              [blob for _, _, blob in jobs], fsync=self.cfg.disk_fsync)
            except OSError as e:
                errors = [e] * len(jobs)
            for i, (key, e) in enumerate(zip(keys, errors)):
                if e is None:
                    ok[i] = True
                elif isinstance(e, diskfmt.BlockRefused):
                    logger.warning("KVBMConnector: disk block %s not stored (%s)", diskfmt.key_hex(key), e)
                elif not self._disk_broken:
                    self._disk_broken = True
                    logger.warning("KVBMConnector: disk tier write failed (%s); no more disk writes", e)
        self._disk_done("write", sum(ok), len(jobs), t0)
        for (key, _, _), good in zip(jobs, ok):
            self._disk_results.put((key, good))

    def wait_for_disk(self, timeout: float = 30.0) -> None:
        """Block until queued disk writes and remote operations are done (shutdown, tests)."""
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
        self.direct = remotefmt.DirectReader(url) if remotefmt.DirectReader.supports(url) else None
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
        # a DirectReader reads straight into the slots, verified as the bytes land
        results = remotefmt.fetch_values(self.direct or self.client, names, keys, self.side.fingerprint, outs)
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
        pipe = self.client.pipeline(transaction=False)
        pool, fp = self.side.pool, self.side.fingerprint
        for _, key, slot, meta in writes:
            parts = remotefmt.value_parts(key, fp, pool[slot].numpy(), meta)
            pipe.set(self.prefix + diskfmt.key_hex(key), b"".join(parts))
        pipe.execute()
