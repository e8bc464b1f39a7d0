"""A tier added through the contracts alone (connector/base.py), for tests: both halves in one
module, registered by naming it in `tier_module_paths`, as a user's own tier would be.

It keeps each entry as a plain file per rank, `<disk_path>/fake-tier/<key hex>.r<rank>` (the
slot's bytes, nothing else), so the scheduler half and the workers, in other processes, share it
as they would a store. A file of the wrong size is a miss. Not a tier to run: no MAC, no bound,
no events.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.block_events import Announcer
from vllm_kvbm_plugin.connector.base import (Key, Report, SlotJobs, TierJob, TierJobs, TierModule, TierOp, Verb,
                                             WorkerContext)
from vllm_kvbm_plugin.connector.layout import Layout
from vllm_kvbm_plugin.events.types import storage_tier

LABEL = "fake"
FETCH, WRITE = TierOp(LABEL, Verb.FETCH), TierOp(LABEL, Verb.WRITE)


def _path(disk_path: str, key: Key, rank: int) -> str:
    return os.path.join(disk_path, "fake-tier", f"{key[0]:016x}{key[1]:016x}.r{rank}")


class FakeTier(SlotJobs):
    """The scheduler half (a base.SecondaryTier). Remembers what it was asked, for tests."""

    label, name, waits, direct = LABEL, storage_tier("fake-tier"), False, False
    FETCH, WRITE = FETCH, WRITE

    @classmethod
    def create(cls, layout: Layout, cfg: KVBMConfig) -> FakeTier | None:
        return cls(layout) if layout.disk_path else None

    def __init__(self, layout: Layout) -> None:
        if not layout.disk_path:
            raise ValueError("the fake tier keeps its blocks under disk_path, which is not set")
        self.disk_path, self.world = layout.disk_path, layout.world
        self.fetching: set[Key] = set()
        self.writing: set[Key] = set()
        self.looked_up: set[Key] = set()
        self.loaded: set[Key] = set()
        self.stored: set[Key] = set()
        self.finished: set[str] = set()

    def describe(self) -> str:
        return f"fake tier under {self.disk_path}"

    def _held(self, key: Key) -> bool:
        return all(os.path.exists(_path(self.disk_path, key, r)) for r in range(self.world))

    def lookup(self, key: Key) -> bool:
        self.looked_up.add(key)
        return self._held(key)

    def prepare_lookup(self, req_id: str, keys: list[Key]) -> bool:
        return True

    def busy_loading(self, key: Key) -> bool:
        return key in self.fetching

    def announcement(self, key: Key) -> Announcer | None:
        return None

    def prefetch(self, key: Key) -> None:
        self.fetching.add(key)

    def prepare_write(self, key: Key, parent: Key | None, end: int, announce: Announcer) -> bytes | None:
        if key in self.writing or self._held(key):
            return None
        self.writing.add(key)
        return b""  # no metadata: the fake tier keeps no events

    def settle(self, op: TierOp, key: Key, ok: bool) -> None:
        if op.verb is Verb.FETCH:
            self.fetching.discard(key)
            if ok:
                self.loaded.add(key)
        else:
            self.writing.discard(key)
            if ok:
                self.stored.add(key)

    def hold(self, key: Key, req_id: str) -> bool:
        return False

    def ready_direct(self, key: Key) -> bool:
        return False

    def release(self, req_id: str) -> None:
        return

    def on_request_finished(self, req_id: str) -> None:
        self.finished.add(req_id)

    def on_schedule_end(self, meta: TierJobs) -> None:
        return

    def worker_failed(self) -> None:
        return

    def has_pending_work(self) -> bool:
        return bool(self.fetching or self.writing)

    def accounting(self) -> dict[str, object]:
        return {LABEL: {"fetching": len(self.fetching), "writing": len(self.writing)}}

    def take_events(self) -> list:
        return []

    def take_stats(self) -> dict[str, int]:
        return {}


class FakeWorker:
    """The worker half (a base.WorkerTier): reads and writes this rank's files at once."""

    label = LABEL

    @classmethod
    def open(cls, side: WorkerContext) -> FakeWorker | None:
        return cls(side) if side.layout.disk_path else None

    def __init__(self, side: WorkerContext) -> None:
        if not side.layout.disk_path:
            raise ValueError("the fake tier keeps its blocks under disk_path, which is not set")
        self.side, self.disk_path = side, side.layout.disk_path
        self.reports: list[Report] = []
        os.makedirs(os.path.join(self.disk_path, "fake-tier"), mode=0o700, exist_ok=True)

    def _path(self, key: Key) -> str:
        return _path(self.disk_path, key, self.side.rank)

    def _pool(self) -> torch.Tensor:
        if self.side.pool is None:
            raise RuntimeError("the fake tier copies before the KV caches are registered")
        return self.side.pool

    def start(self, jobs: list[TierJob]) -> None:
        t0, n = time.perf_counter(), 0
        for j in jobs:
            ok = False
            try:
                data = np.fromfile(self._path(j.key), dtype=np.uint8)
                if data.size == self.side.slot_bytes:
                    self._pool()[j.slot].numpy()[:] = data
                    ok = True
            except OSError:
                pass
            self.reports.append(Report(j.op, j.key, ok))
            n += ok
        if n:
            self.side.record(LABEL, "read", n, t0)

    def write(self, jobs: list[TierJob]) -> None:
        t0 = time.perf_counter()
        for j in jobs:
            path = self._path(j.key)
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self._pool()[j.slot].numpy().tobytes())
            os.replace(path + ".tmp", path)
            self.reports.append(Report(j.op, j.key, True))
        self.side.record(LABEL, "write", len(jobs), t0)

    def drop(self, jobs: list[TierJob]) -> None:
        self.reports += [Report(j.op, j.key, False) for j in jobs]

    def close(self, keys: list[Key]) -> None:
        return

    def read_held(self, key: Key, parts: list[np.ndarray]) -> bool:
        return False

    def take_reports(self) -> list[Report]:
        reports, self.reports = self.reports, []
        return reports

    def take_broken(self) -> bool:
        return False

    def take_stats(self) -> dict[str, int]:
        return {}

    def drain(self, timeout: float) -> None:
        return

    def shutdown(self) -> None:
        return


TIER = TierModule(FakeTier.create, FakeWorker.open)
