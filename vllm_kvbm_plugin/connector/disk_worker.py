"""The disk tier, worker half (each worker process): this rank's block files under
`<disk_path>/<layout root>/r<rank>/` (tiers/disk.py), as its scheduler half (disk_scheduler.py)
plans them. Reads (FETCH into CPU slots, OPEN to verify and hold a file for a direct load) run at
once, before the step's loads; writes run on a background thread from slots the scheduler side
keeps pinned until they are reported. Every file read is verified before its bytes count.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from vllm_kvbm_plugin.connector.base import Key, Report, TierJob, Verb, WorkerContext, registered
from vllm_kvbm_plugin.connector.disk_scheduler import DiskTier
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import block_dir, block_file

if TYPE_CHECKING:
    from vllm_kvbm_plugin.config import KVBMConfig

logger = get_logger("connector.worker")


def run_batches(jobs: queue.SimpleQueue, limit: int, run: Callable[[list], object]) -> None:
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


class DiskWorker:
    """A base.WorkerTier: this rank's block files. Holds the files verified for direct loads open
    (`held`) until the scheduler side closes them; a write failing as a whole (a full disk)
    pauses writes for WRITE_PAUSE_S and is reported as the tier broken (`take_broken`)."""

    label = DiskTier.label
    WRITE_BATCH = 32  # blocks per GIL-free write call (their reports wait for the whole batch)

    @classmethod
    def open(cls, side: WorkerContext) -> DiskWorker | None:
        disk_path, base = side.layout.disk_path, side.layout.rank_dir(side.rank)
        return cls(side, disk_path, base) if disk_path and base is not None else None

    def __init__(self, side: WorkerContext, disk_path: str, base: str) -> None:
        self.side, self.base = side, base
        self.reports: list[Report] = []
        self.held: dict[Key, int] = {}  # key -> open, verified block file (direct loads)
        self._results: queue.SimpleQueue = queue.SimpleQueue()  # (key, ok) of writes, from the writer thread
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._broken = False  # the tier directory was unusable at start: no writes at all
        self._resume = 0.0  # monotonic time writes resume after failing as a whole
        self._failed = False  # such a failure, not yet reported to the scheduler side
        try:  # 0700 whatever the umask; existing tier directories are tightened (logged)
            block_dir.prepare_block_dir(disk_path, base)
        except OSError as e:
            self._broken = True
            logger.warning("KVBMConnector: disk tier directory %s unusable (%s); no more disk writes", base, e)

    def _paths(self, keys: list[Key]) -> list[str]:
        return [block_dir.block_path(self.base, k) for k in keys]

    def _done(self, operation: str, ok: int, n: int, t0: float) -> None:
        """Stats of one batched call: `ok` of `n` blocks done, the rest failed."""
        if ok:
            self.side.record(self.label, operation, ok, t0)
        for _ in range(n - ok):
            self.side.failed(self.label, operation)

    # ---- reads -----------------------------------------------------------------------------
    def start(self, jobs: list[TierJob]) -> None:
        side = self.side
        opens = [j.key for j in jobs if j.op.verb is Verb.OPEN]
        fetches = [j for j in jobs if j.op.verb is Verb.FETCH]
        if opens:  # verified and kept open for a direct load next step, all in one call
            t0 = time.perf_counter()
            reg = registered(side)
            opened = block_file.open_verified_blocks(self._paths(opens), opens, reg.fingerprint, reg.mac_key,
                                                  side.slot_bytes)
            for key, o in zip(opens, opened):
                if o is not None:
                    old = self.held.pop(key, None)
                    if old is not None:
                        os.close(old)
                    self.held[key] = o[0]
                self.reports.append(Report(DiskTier.OPEN, key, o is not None))
            self._done("read", sum(o is not None for o in opened), len(opens), t0)
        if fetches:  # read and verified straight into their (not yet ready) slots
            t0 = time.perf_counter()
            keys = [j.key for j in fetches]
            reg = registered(side)
            metas = block_file.read_blocks(self._paths(keys), keys, reg.fingerprint, reg.mac_key,
                                        [reg.pool[j.slot].numpy() for j in fetches])
            self.reports += [Report(DiskTier.FETCH, key, m is not None) for key, m in zip(keys, metas)]
            self._done("read", sum(m is not None for m in metas), len(keys), t0)

    def read_held(self, key: Key, parts: list[np.ndarray]) -> bool:
        fd = self.held.get(key)
        return fd is not None and block_file.read_payload(fd, parts, registered(self.side).mac_key)

    def close(self, keys: list[Key]) -> None:
        for key in keys:
            fd = self.held.pop(key, None)
            if fd is not None:
                os.close(fd)

    # ---- writes ----------------------------------------------------------------------------
    def _writes_on(self) -> bool:
        return not self._broken and time.monotonic() >= self._resume

    def write(self, jobs: list[TierJob]) -> None:
        if not self._writes_on():
            self.drop(jobs)
            return
        if self._writer is None:
            self._writer = threading.Thread(target=run_batches, name="kvbm-disk-writer", daemon=True,
                                            args=(self._jobs, self.WRITE_BATCH, self._write_batch))
            self._writer.start()
        for j in jobs:
            self._jobs.put(j)

    def drop(self, jobs: list[TierJob]) -> None:
        for j in jobs:
            self._results.put((j.key, False))

    def _write_batch(self, jobs: list[TierJob]) -> None:
        """Write block files from their slots (pinned by the scheduler until reported) in one call
        that holds no GIL. A name taken by something not ours fails that block alone; any other
        error (a full disk) pauses disk writes for WRITE_PAUSE_S, here and on the scheduler side."""
        side = self.side
        ok = [False] * len(jobs)
        t0 = time.perf_counter()
        if self._writes_on():
            keys = [j.key for j in jobs]
            reg = registered(side)
            try:
                errors = block_file.write_blocks(self._paths(keys), keys, reg.fingerprint, reg.mac_key,
                                              [reg.pool[j.slot].numpy() for j in jobs],
                                              [j.meta for j in jobs], fsync=side.cfg.disk_fsync)
            except OSError as failure:
                errors = [failure] * len(jobs)
            for i, (key, e) in enumerate(zip(keys, errors)):
                if e is None:
                    ok[i] = True
                elif isinstance(e, block_file.BlockRefused):
                    logger.warning("KVBMConnector: disk block %s not stored (%s)", block_dir.key_hex(key), e)
                elif self._writes_on():
                    self._resume = time.monotonic() + block_file.WRITE_PAUSE_S
                    self._failed = True
                    logger.warning("KVBMConnector: disk tier write failed (%s); disk writes pause for %.0f s",
                                   e, block_file.WRITE_PAUSE_S)
        self._done("write", sum(ok), len(jobs), t0)
        for j, good in zip(jobs, ok):
            self._results.put((j.key, good))

    # ---- reports ---------------------------------------------------------------------------
    def take_reports(self) -> list[Report]:
        reports, self.reports = self.reports, []
        while True:
            try:
                key, ok = self._results.get_nowait()
            except queue.Empty:
                return reports
            reports.append(Report(DiskTier.WRITE, key, ok))

    def take_broken(self) -> bool:
        failed, self._failed = self._failed, False
        return self._broken or failed

    def take_stats(self) -> dict[str, int]:
        return {}  # its transfers and failures are recorded as they happen (WorkerContext.record)

    def drain(self, timeout: float) -> None:
        if self._writer is not None:
            self._jobs.put(None)
            self._writer.join(timeout)
            self._writer = None

    def shutdown(self) -> None:
        self.drain(30.0)
        self.close(list(self.held))


def disk_peaks(cfg: KVBMConfig, slot_bytes: int) -> dict[str, float]:
    """The disk tier's peak speeds on disk_path's file system (measure_roofline)."""
    from vllm_kvbm_plugin.tiers import roofline

    if not cfg.disk_path or not os.path.isdir(cfg.disk_path):
        return {}
    return roofline.disk_peaks(cfg.disk_path)
