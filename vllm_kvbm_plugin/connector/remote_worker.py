"""The shared remote tier (Redis / Valkey), worker half (each worker process): this rank's values,
as its scheduler half (remote_scheduler.py) plans them, in the format of tiers/remote.py.

One thread and one connection per worker. Fetches (verified into their not-yet-ready CPU slots)
and writes (from slots the scheduler side keeps pinned until reported) are taken in batches, one
pipelined round trip each; a value that does not verify is deleted. Every failure is a miss,
reported like any other (the Breaker then spares the server for a while).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from vllm_kvbm_plugin.connector.base import Key, Report, TierJob, Verb, WorkerContext, registered
from vllm_kvbm_plugin.connector.disk_worker import run_batches
from vllm_kvbm_plugin.connector.remote_scheduler import RemoteCounters, RemoteTier
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import block_dir, remote_value, resp
from vllm_kvbm_plugin.tiers.breaker import Breaker

if TYPE_CHECKING:
    from vllm_kvbm_plugin.config import KVBMConfig

logger = get_logger("connector.worker")


class RemoteWorker:
    """A base.WorkerTier: this rank's values on the server, through a thread of its own. Connects
    at once, in the background: the first fetch finds its connections open."""

    label = RemoteTier.label
    BATCH = 64

    @classmethod
    def open(cls, side: WorkerContext) -> RemoteWorker | None:
        url = side.cfg.remote_url
        if not url or side.layout.remote_off:  # off everywhere: the scheduler side's decision
            return None
        return cls(side, url)

    def __init__(self, side: WorkerContext, url: str) -> None:
        self.side, self.url = side, url
        self.prefix = remote_value.key_prefix(side.layout.decided_root(), side.rank)
        self.breaker = Breaker(f"worker {side.rank}", url)
        self.changes = RemoteCounters()  # the breaker's changes per stats interval
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.client: resp.RedisPyClient | None = None
        self.direct = resp.DirectClient(url) if resp.DirectClient.supports(url) else None
        self._start()

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="kvbm-remote-io", daemon=True)
            self.thread.start()

    # ---- the contract (base.WorkerTier) -----------------------------------------------------
    def start(self, jobs: list[TierJob]) -> None:
        self._submit(jobs)  # fetches: the request waits until they are reported

    def write(self, jobs: list[TierJob]) -> None:
        self._submit(jobs)

    def _submit(self, jobs: list[TierJob]) -> None:
        self._start()
        for j in jobs:
            self.jobs.put(j)

    def drop(self, jobs: list[TierJob]) -> None:
        for j in jobs:
            self.results.put(Report(j.op, j.key, False))

    def close(self, keys: list[Key]) -> None:
        return  # it holds nothing open

    def read_held(self, key: Key, parts: list[np.ndarray]) -> bool:
        return False  # not a direct tier

    def take_reports(self) -> list[Report]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    def take_broken(self) -> bool:
        return False  # each failure is a miss, reported as such

    def take_stats(self) -> dict[str, int]:
        """The worker breaker's changes since the last call."""
        return self.changes.take(breaker=self.breaker, side="worker")

    def drain(self, timeout: float) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join(timeout)
            self.thread = None
            if self.direct is not None:
                self.direct.close()

    def shutdown(self) -> None:
        self.drain(30.0)

    # ---- the thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.client is None and self.breaker.allow():
            try:
                self.client = resp.connect_ready(self.url)
                if self.direct is not None:
                    self.direct.connect()
                self.breaker.success()
            except Exception as e:  # down at startup: a miss until the breaker lets a batch probe it
                self.breaker.failure(e)
        run_batches(self.jobs, self.BATCH, self._run)

    def _run(self, batch: list[TierJob]) -> None:
        fetches = [j for j in batch if j.op.verb is Verb.FETCH]
        writes = [j for j in batch if j.op.verb is Verb.WRITE]
        done: set[tuple[Verb, Key]] = set()
        if self.breaker.allow():
            t0 = time.perf_counter()
            try:
                self._redis()
                if fetches:
                    done = self._fetch(fetches, t0)
                t0 = time.perf_counter()
                if writes:
                    self._write(writes)
                    self.side.record(self.label, "write", len(writes), t0)
                    done.update((Verb.WRITE, j.key) for j in writes)
                self.breaker.success()
            except Exception as e:  # down, slow, reset, paused, out of memory: a miss
                self.breaker.failure(e)
        for j in batch:
            self.results.put(Report(j.op, j.key, (j.op.verb, j.key) in done))
        if fetches:
            resp.LANDINGS.landed()  # a scheduler side in this process waiting for them goes on

    def _redis(self) -> resp.RedisPyClient:
        """The redis-py client, connected now if it is not (the thread only)."""
        if self.client is None:
            self.client = resp.connect(self.url)
        return self.client

    def _fetch(self, fetches: list[TierJob], t0: float) -> set[tuple[Verb, Key]]:
        side = self.side
        keys = [j.key for j in fetches]
        names = [self.prefix + block_dir.key_hex(key) for key in keys]
        reg = registered(side)
        outs = [reg.pool[j.slot].numpy() for j in fetches]
        # a DirectClient reads straight into the slots, verified as the bytes land
        results = resp.fetch_values(self.direct or self._redis(), names, keys, reg.fingerprint,
                                         reg.mac_key, outs)
        done: set[tuple[Verb, Key]] = set()
        bad: list[str] = []
        for key, name, r in zip(keys, names, results):
            if r == remote_value.BAD:
                bad.append(name)
                logger.warning("KVBMConnector: remote value %s does not verify; deleted (a miss)",
                               block_dir.key_hex(key))
            if r == remote_value.OK:
                done.add((Verb.FETCH, key))
        if bad:
            resp.delete_values(self._redis(), bad)
        if done:
            side.record(self.label, "read", len(done), t0)
        return done

    def _write(self, writes: list[TierJob]) -> None:
        names = [self.prefix + block_dir.key_hex(j.key) for j in writes]
        reg = registered(self.side)
        values = [remote_value.value_parts(j.key, reg.fingerprint, reg.mac_key, reg.pool[j.slot].numpy(), j.meta)
                  for j in writes]
        resp.store_values(self.direct or self._redis(), names, values)


def remote_peaks(cfg: KVBMConfig, slot_bytes: int) -> dict[str, float]:
    """The remote tier's peak speeds against the configured server (measure_roofline), on a
    connection of the measurement's own."""
    from vllm_kvbm_plugin.tiers import roofline

    if not cfg.remote_url:
        return {}
    client = resp.connect(cfg.remote_url)
    try:
        return roofline.remote_peaks(client, slot_bytes)
    finally:
        client.close()
