"""KVBMConnector, worker side: the CPU pool, copies against vLLM's KV tensors, and the worker
halves of the tiers below (base.WorkerTier: disk_worker.py, remote_worker.py, ...), which run the
step's TierJobs.

Each tier entry is one contiguous pool slot: a block's bytes of every attention layer, one after
another (or, for hybrid models, the Mamba state of every state layer at one position), so a disk
file or a remote value is a slot. Copies go through the transfer engine (tiers/transfer.py): on
CPU done before the hook returns, on CUDA asynchronous on a side stream, reported when their event
has passed (a store's WRITE jobs are handed to their tiers only then: they read its slots).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.base import Report, TierJob, Verb, WorkerTier
from vllm_kvbm_plugin.connector.layout import KV, EntryKind, Layout, TierDecision, tensor_fingerprint
from vllm_kvbm_plugin.connector.metadata import (
    STORE,
    DirectLoad,
    KVBMMetadata,
    KVBMWorkerMetadata,
    copy_count,
    copy_ops,
)
from vllm_kvbm_plugin.connector.stats import KVBMStats
from vllm_kvbm_plugin.connector.tier_modules import tier_modules
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import host_memory
from vllm_kvbm_plugin.tiers.block_dir import key_hex
from vllm_kvbm_plugin.tiers.mac import mac_key
from vllm_kvbm_plugin.tiers.transfer import Layer, TransferEngine, slots_to_layer

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

logger = get_logger("connector.worker")


class WorkerSide:
    """KVBMConnector's worker side, one per worker process (tensor-parallel rank): owns this
    rank's CPU pool (the CPU tier's slots), its view of vLLM's KV tensors (`layers`), the worker
    halves of the tiers below (`tiers`, a base.WorkerContext to them) and the transfer stats.
    KVBMConnector calls it each step: `start_load_kv` before the forward (the tiers' OPEN and
    FETCH jobs, loads: from CPU slots, direct from a tier's open entries, position-independent),
    `wait_for_save` after it (stores into slots, then the tiers' WRITE jobs), `build_worker_meta`
    to report what finished to the scheduler side."""

    fingerprint: bytes | None  # of the exact byte layout of an entry, under the key root
    mac_key: np.ndarray | None  # of block files and remote values, once the decision is known (_open_tiers)
    tiers: list[WorkerTier]  # the tiers below the CPU tier (_open_tiers), in lookup order
    _by_label: dict[str, WorkerTier]

    def __init__(self, layout: Layout, cfg: KVBMConfig, rank: int) -> None:
        self.layout, self.cfg, self.rank = layout, cfg, rank
        self.slot_bytes = layout.slot_bytes
        self._init_state()
        if layout.root is not None:  # a layout decided already (tests); an engine's worker follows the first step's
            self._open_tiers()

    def follow(self, decision: TierDecision) -> None:
        """Take the scheduler side's decision (the first step's metadata): the tier secret, the key
        root and whether the remote tier is on, then open the tiers' worker halves under it. A
        worker never reads the secret or probes the server itself, so all ranks agree with the
        scheduler side whatever each process saw at startup."""
        if self.layout.root is not None:
            if (decision.root, decision.secret) != (self.layout.root, self.layout.secret):
                raise RuntimeError(f"KVBMConnector worker {self.rank}: told {decision!r}, but it follows another "
                                   "decision already (the key root differs)")
            return
        self.layout = self.layout.following(decision)
        if self.described is not None:
            self.fingerprint = tensor_fingerprint(self.layout.decided_root(), self.described)
        self._open_tiers()
        logger.info("KVBMConnector worker %d follows the scheduler side: %r", self.rank, decision)

    def _open_tiers(self) -> None:
        """The worker halves of the configured tiers, under the decided root and the MAC key of
        their entries (tiers/mac.py), derived once from the secret."""
        self.mac_key = mac_key(self.layout.secret)
        self.tiers = [t for t in (m.worker(self) for m in tier_modules(self.cfg)) if t is not None]
        self._by_label = {t.label: t for t in self.tiers}

    def tier(self, label: str) -> WorkerTier | None:
        """The worker half of the tier of that label, or None (not configured)."""
        return self._by_label.get(label)

    def _init_state(self) -> None:
        # kind -> per group of that kind, its layers (each with its offset inside a slot)
        self.layers: dict[EntryKind, list[list[Layer]]] = {}
        self.pool: torch.Tensor | None = None
        self.copies: TransferEngine | None = None
        self._jobs: dict = {}  # copy job -> (direction, blocks, store batch, WRITE jobs handed over once done)
        self._last_store: int | None = None  # the newest store job still in flight
        self.reports: list[Report] = []
        self.tiers = []
        self._by_label = {}
        self.load_errors: set[int] = set()  # block ids of failed direct loads, for vLLM's failure policy
        self.recved: set[str] = set()  # requests whose asynchronous loads ran (KVBMMetadata.recving)
        self.failed_recving: set[str] = set()  # those of them with a failed load
        self._loads_failed = False  # a load of this step failed: its stores must not run (wait_for_save)
        self.stats = KVBMStats()
        self._stats_lock = threading.Lock()  # the tiers' threads record too
        self.peaks: dict[str, float] = {}  # "<tier>_<direction>" -> bytes/s (measure_roofline)
        self.mac_key = None
        self.described: list | None = None  # the KV layers' layout (register_kv_caches), for the fingerprint
        self.fingerprint = None

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

    def _rows(self) -> torch.Tensor:
        """The pool, allocated by register_kv_caches (every copy comes after it)."""
        if self.pool is None:
            raise RuntimeError("KVBMConnector: a copy before the KV caches are registered")
        return self.pool

    def _engine(self) -> TransferEngine:
        if self.copies is None:
            raise RuntimeError("KVBMConnector: a copy before the KV caches are registered")
        return self.copies

    def _measure_roofline(self) -> None:
        """This machine's peak per transfer kind (tiers/roofline.py), before any request: every stats
        interval then carries it, and the log line and a gauge show each tier's speed as a share."""
        from vllm_kvbm_plugin.tiers import roofline

        t0 = time.perf_counter()
        kv = next(layer.tensor for groups in self.layers.values() for layers in groups for layer in layers)
        pool = self._rows()
        n = min(kv.untyped_storage().nbytes(), pool.numel(), 256 << 20)
        kv_bytes = torch.empty(0, dtype=torch.uint8, device=kv.device).set_(kv.untyped_storage(), 0, (n,), (1,))
        peaks = roofline.copy_peaks(kv_bytes, pool.view(-1)[:n])
        for m in tier_modules(self.cfg):  # before the scheduler side's decision: the configured places
            try:
                if m.peaks is not None:
                    peaks.update(m.peaks(self.cfg, self.slot_bytes))
            except Exception as e:  # a tier that cannot be measured is left out, never fatal
                logger.warning("KVBMConnector: roofline measurement incomplete (%s)", e)
        self.peaks = roofline.per_direction(peaks)
        logger.info("KVBMConnector roofline (%.1f s): %s", time.perf_counter() - t0,
                    ", ".join(f"{d} {v / 2**30:.2f} GiB/s" for d, v in self.peaks.items()))

    # ---- copies ----------------------------------------------------------------------------
    def _copy(self, ops: list[tuple[EntryKind, tuple[int, ...], int]], to_pool: bool) -> None:
        """Copy (kind, block id per group, slot) ops and wait for them (tests, benchmarks)."""
        self._engine().submit(ops, to_pool)
        self._engine().wait()

    def _poll(self) -> None:
        """Settle the copy jobs finished since the last call: stats, store reports, and the writes
        that waited for their slots."""
        for job, seconds in self.copies.get_finished() if self.copies is not None else ():
            entry = self._jobs.pop(job, None)
            if entry is None:
                continue  # a _copy
            direction, blocks, batch, writes = entry
            self.record("cpu", direction, blocks, time.perf_counter() - seconds)
            if batch:
                self.reports.append(Report(STORE, batch, True))
            self._write(writes)
            if job == self._last_store:
                self._last_store = None

    def _load_direct(self, d: DirectLoad) -> bool:
        """Read an entry its tier holds open straight into its blocks: a view of the block's page per
        layer, in slot order (layers without page views go through the scratch slot)."""
        tier, kind, ids = self._by_label.get(d.tier), d.kind, d.block_ids
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
        if tier is None or not tier.read_held(d.key, parts):
            return False
        for layer, block_id in via_scratch:
            slots_to_layer(layer, [block_id], [0], self.scratch)
        return True

    def load_direct_staged(self, loads: list[DirectLoad]) -> None:
        """Direct loads through pinned staging (CUDA; the CPU path reads straight into the KV
        pages): each batch of held-open, verified entries is read into the pool's staging rows and
        moved into its blocks by one load job, which the forward's stream waits for, instead of a
        pageable scratch slot copied layer by layer, block by block, each a synchronous copy. A batch
        reuses the rows once the previous load job has read them. A file that no longer reads back
        verified is a failed load, handled as on the CPU path (_direct_load_failed)."""
        first = self.layout.cpu_slots
        for at in range(0, len(loads), self.direct_rows):
            self._engine().wait_loads()  # the previous batch (this step's or the last) has left the rows
            ops = []
            for row, d in enumerate(loads[at:at + self.direct_rows], first):
                tier = self._by_label.get(d.tier)
                if tier is not None and tier.read_held(d.key, [self._rows()[row].numpy()]):
                    ops.append((d.kind, d.block_ids, row))
                else:
                    self._direct_load_failed(d)
            if ops:
                self._engine().submit(ops, to_pool=False)

    # ---- connector hooks -------------------------------------------------------------------
    def record(self, tier: str, direction: str, blocks: int, t0: float) -> None:
        with self._stats_lock:
            self.stats.record(tier, direction, blocks, blocks * self.slot_bytes, time.perf_counter() - t0)

    def failed(self, tier: str, operation: str) -> None:
        with self._stats_lock:
            self.stats.failure(tier, operation)

    def _count(self, counters: dict[str, int]) -> None:
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

    def _by_tier(self, jobs: list[TierJob], verbs: tuple[Verb, ...]) -> dict[str, list[TierJob]]:
        """The jobs of those verbs, by tier label, in order."""
        out: dict[str, list[TierJob]] = {}
        for j in jobs:
            if j.op.verb in verbs:
                out.setdefault(j.op.tier, []).append(j)
        return out

    def _tier_of(self, label: str) -> WorkerTier:
        tier = self._by_label.get(label)
        if tier is None:
            raise RuntimeError(f"KVBMConnector worker {self.rank}: a job for tier {label!r}, which this worker "
                               f"does not have (it has {sorted(self._by_label)}); the sides disagree on the tiers")
        return tier

    def start_load_kv(self, meta: KVBMMetadata, forward_context: ForwardContext | None = None) -> None:
        if meta.decision is not None:
            self.follow(meta.decision)
        elif self.layout.root is None:
            raise RuntimeError("KVBMConnector: a worker got work before the scheduler side's decision (the first "
                               "step's metadata carries it); vLLM delivered the steps out of order")
        self._loads_failed = False
        if meta.jobs:
            reads = self._by_tier(meta.jobs, (Verb.OPEN, Verb.FETCH))
            if any(j.op.verb is Verb.FETCH for js in reads.values() for j in js):
                self._engine().wait_loads()  # slots a load still reads may be written now
            for label, jobs in reads.items():
                self._tier_of(label).start(jobs)
        if meta.loads:  # the forward waits for them (on CUDA its stream does, not the host)
            job = self._engine().submit(copy_ops(meta.loads), to_pool=False)
            self._jobs[job] = ("load", copy_count(meta.loads), 0, [])
            self._poll()
        if meta.direct_loads:
            t0 = time.perf_counter()
            if self._engine().cuda:  # through pinned staging rows, a load job per batch
                self.load_direct_staged(meta.direct_loads)
            else:
                for d in meta.direct_loads:
                    if not self._load_direct(d):
                        self._direct_load_failed(d)
            for label in {d.tier for d in meta.direct_loads}:
                self.record(label, "load", sum(d.tier == label for d in meta.direct_loads), t0)
        self.recved.update(meta.recving)
        if meta.pic_queries:  # the scheduler side split a request's query (patches/pic_segments.py)
            from vllm_kvbm_plugin.patches import pic_segments

            if not pic_segments.applied():
                raise RuntimeError("KVBMConnector: split queries sent to a model runner without the pic_segments patch")
        if meta.pic_loads:
            from vllm_kvbm_plugin.connector import pic_load
            from vllm_kvbm_plugin.connector.pic_model import PicModel

            model = self.cfg.pic_model
            if not isinstance(model, PicModel):
                raise RuntimeError(f"KVBMConnector: position-independent loads sent for a model they do not serve ({model})")
            pic_load.load(meta.pic_loads, model, self.layout.block_size, self.layers[KV], self._rows(),
                          self.cfg.pic_recompute_ratio, self._blocks_failed, self._count, forward_context)
        if meta.jobs:
            for label, jobs in self._by_tier(meta.jobs, (Verb.CLOSE,)).items():
                self._tier_of(label).close([j.key for j in jobs])

    def wait_for_save(self, meta: KVBMMetadata) -> None:
        if self._loads_failed:
            self._drop_saves(meta)
            return
        writes = [j for j in meta.jobs if j.op.verb is Verb.WRITE]
        if meta.stores:
            job = self._engine().submit(copy_ops(meta.stores), to_pool=True)
            self._jobs[job] = ("store", copy_count(meta.stores), meta.store_batch, [])
            self._last_store = job
        if self._last_store is not None:  # writes read slots stores fill: handed over once they are done
            self._jobs[self._last_store][3].extend(writes)
        else:
            self._write(writes)
        self._poll()

    def _write(self, writes: list[TierJob]) -> None:
        """Hand WRITE jobs, whose slots hold the stored bytes now, to their tiers."""
        for label, jobs in self._by_tier(writes, (Verb.WRITE,)).items():
            self._tier_of(label).write(jobs)

    def _drop_saves(self, meta: KVBMMetadata) -> None:
        """A load of this step failed: its blocks hold whatever was in them, and the forward that
        just ran read them (any request that shares them too). vLLM recomputes from the failed
        block on, but nothing this step would store can be trusted, so none of it reaches a tier:
        the step's stores fail as one, and its WRITE jobs (they read the slots those stores fill)
        are not made. A miss, never a wrong block kept."""
        if meta.stores:
            self.reports.append(Report(STORE, meta.store_batch, False))
        writes = self._by_tier(meta.jobs, (Verb.WRITE,))
        for label, jobs in writes.items():
            self._tier_of(label).drop(jobs)
        n = copy_count(meta.stores) if meta.stores else 0
        if n or writes:
            logger.warning("KVBMConnector: a load failed; this step's %d stores and %d writes are dropped",
                           n, sum(map(len, writes.values())))

    def build_worker_meta(self) -> KVBMWorkerMetadata | None:
        self._poll()
        reports, self.reports = self.reports, []
        broken: list[str] = []
        for t in self.tiers:
            reports += t.take_reports()
            if t.take_broken():
                broken.append(t.label)
        if not reports:
            return None
        return KVBMWorkerMetadata(reports, broken=tuple(broken))

    def _direct_load_failed(self, d: DirectLoad) -> None:
        """Verified a step ago and held open since: only a failing device, or someone changing the
        entry in place meanwhile (read_held checks the bytes again), gets here. vLLM then follows
        its kv_load_failure_policy (recompute, or fail the request). An asynchronous load (hybrid
        models: vLLM takes block-level errors for one KV cache group only) fails its request's
        load as a whole; its blocks are that waiting request's alone, nothing else read them. A
        synchronous one reports its blocks, and the step's stores are dropped (the forward read them)."""
        self.failed(d.tier, "read")
        if d.request is not None:
            self.failed_recving.add(d.request)
            logger.error("KVBMConnector: direct load of %s block %s failed; request %s recomputes",
                         d.tier, key_hex(d.key), d.request)
            return
        self._loads_failed = True
        self.load_errors.update(d.block_ids)
        logger.error("KVBMConnector: direct load of %s block %s failed; reported to vLLM", d.tier, key_hex(d.key))

    def take_recving(self) -> tuple[set[str], set[str]]:
        """(requests whose asynchronous loads ran, those of them that failed) since the last call:
        vLLM's finished_recving and failed_recving (a failed one is both, as vLLM wants it)."""
        done, failed = self.recved, self.failed_recving
        self.recved, self.failed_recving = set(), set()
        return done, failed

    def _blocks_failed(self, ids: Iterable[int]) -> None:
        """Position-independent loads that failed: vLLM recomputes them; this step stores nothing."""
        self._loads_failed = True
        self.load_errors.update(ids)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def take_tier_stats(self) -> dict[str, int]:
        """The tiers' own counters since the last call (stats.py names)."""
        out: dict[str, int] = {}
        for t in self.tiers:
            out.update(t.take_stats())
        return out

    def wait_for_disk(self, timeout: float = 30.0) -> None:
        """Block until copies and every tier's queued work are done (shutdown, tests)."""
        if self.copies is not None:
            self.copies.wait()
            self._poll()
        for t in self.tiers:
            t.drain(timeout)

    def shutdown(self) -> None:
        self.wait_for_disk()
        for t in self.tiers:
            t.shutdown()


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


DIRECT_STAGING_BYTES = 64 << 20  # CUDA: pinned rows for direct disk loads, past the CPU tier's slots


def direct_staging_rows(slot_bytes: int) -> int:
    """Pool rows set aside on CUDA for direct disk loads: DIRECT_STAGING_BYTES' worth, 2 to 32."""
    return max(2, min(32, DIRECT_STAGING_BYTES // slot_bytes))

