"""The tier contracts of KVBMConnector, one per side, and the tier-generic wire between them.

Modelled on vLLM's own split (vllm/v1/kv_offload): the CPU tier is the primary, the only tier
whose slots the workers copy to and from vLLM's KV blocks (`OffloadingManager`: `lookup`,
`touch`, `prepare_load` / `complete_load`, `prepare_store` / `complete_store`, `take_events`);
every tier below it (disk, remote) is a secondary (`SecondaryTierManager`): stored from a CPU
slot (a write-through) and loaded into one (a prefetch).

A secondary tier is two halves, one per side, joined by a `TierModule`:
- its scheduler half (`SecondaryTier`, EngineCore process) plans `TierJob`s into the step's
  metadata: each names the tier and a `Verb`, which says the job's source and destination (a CPU
  slot, the tier's entry) whatever the tier;
- its worker half (`WorkerTier`, each worker process) runs the jobs naming its label and answers
  each with a `Report`, which the scheduler half settles once every worker reported.
SchedulerSide and WorkerSide hold the tiers as one ordered list, primary first, fastest first: a
hit is looked up tier by tier and loaded from the first tier that holds each entry. Adding a tier
is a module per side and one `TierModule` registered (tier_modules.BUILT_IN, or a module named in
the `tier_module_paths` setting); neither side branches on a tier's name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from vllm_kvbm_plugin.connector.block_events import Announcer
from vllm_kvbm_plugin.events.types import Tier

if TYPE_CHECKING:
    import torch

    from vllm_kvbm_plugin.config import KVBMConfig
    from vllm_kvbm_plugin.connector.layout import Layout
    from vllm_kvbm_plugin.tiers.index import Entry

Key = tuple[int, int]  # an entry's block key (hashing/keys.py)


class Verb(enum.Enum):
    """What a worker operation does, i.e. its source and destination: also what the primary
    settles besides the tier that made it."""
    STORE = "store"  # KV blocks -> a CPU slot: the CPU tier's own store
    FETCH = "fetch"  # the tier's entry -> a CPU slot, verified: completes the CPU tier's store of it
    OPEN = "open"  # the tier's entry verified and held open by the workers (direct loads next)
    CLOSE = "close"  # an entry held open is let go (not reported)
    WRITE = "write"  # a CPU slot -> the tier's entry: the slot, pinned as its source, is released


class TierOp(NamedTuple):
    """An operation of one tier: the tier's label and what it does. Tiers keep theirs as
    constants (e.g. DiskTier.FETCH); a report names the one it answers."""
    tier: str
    verb: Verb


class TierJob(NamedTuple):
    """One entry's operation, planned by a tier's scheduler half into the step's metadata, run by
    its worker half in every worker process. `slot`: the CPU slot a FETCH fills or a WRITE reads
    (pinned by the scheduler side until reported); `meta`: what a WRITE stores beside the bytes
    (the entry's events)."""
    op: TierOp
    key: Key
    slot: int = -1
    meta: bytes = b""


class Report(NamedTuple):
    """Whether one worker's operation on one key (the CPU tier's STORE: on one step's stores)
    succeeded: made by a worker, carried in KVBMWorkerMetadata, counted by the scheduler side's
    Quorum, then settled by the tier `op.tier` names."""
    op: TierOp
    key: Key | int  # the CPU tier's STORE: the step's KVBMMetadata.store_batch
    ok: bool


class TierJobs(Protocol):
    """Where a scheduler half plans its jobs: the step's metadata (metadata.KVBMMetadata)."""
    jobs: list[TierJob]


class SchedulerTier(Protocol):
    """What every scheduler-side tier answers (EngineCore process; called by SchedulerSide only)."""

    label: str  # its name in reports (TierOp.tier) and in SchedulerSide.accounting()
    name: Tier  # its events' medium, locality and ownership

    def lookup(self, key: Key) -> bool:
        """Whether `key` is held and ready to load (vLLM's LookupResult.HIT)."""

    def settle(self, op: TierOp, key: Key, ok: bool) -> None:
        """Every worker reported `op` on `key` (ok: all of them succeeded)."""

    def release(self, req_id: str) -> None:
        """`req_id` no longer waits for what the tier keeps for its loads (planned, or gone)."""

    def on_request_finished(self, req_id: str) -> None:
        """`req_id` is gone: drop all the tier keeps for it."""

    def on_schedule_end(self, meta: TierJobs) -> None:
        """The step's metadata is built: add the tier's end-of-step jobs to `meta`."""

    def worker_failed(self) -> None:
        """A worker's half of the tier failed as a whole (KVBMWorkerMetadata.broken)."""

    def has_pending_work(self) -> bool:
        """Operations whose reports the workers owe, or that need another step (vLLM's name)."""

    def accounting(self) -> dict[str, object]:
        """What the tier holds and has in flight, merged into SchedulerSide.accounting()."""

    def take_events(self) -> list:
        """The tier's BlockStored / BlockRemoved events since the last call, in order."""

    def take_stats(self) -> dict[str, int]:
        """The tier's own counters (connector/stats.py names) since the last call, or {}."""


class PrimaryTier(SchedulerTier, Protocol):
    """The CPU tier (cpu_tier.py): the slots every load into the KV cache comes from and every
    store goes to first. Entries are pinned between prepare_* and complete_*."""

    @property
    def entries(self) -> Mapping[Hashable, Entry]:
        """What it holds, by key (membership tests on the hot path); a TierIndex's."""

    def __contains__(self, key: Key) -> bool: ...

    def slot(self, key: Key) -> int:
        """The CPU slot of the held `key`."""

    def touch(self, key: Key) -> None:
        """`key` was used: the eviction policy's recency."""

    def touch_all(self, keys: list[Key]) -> None: ...

    def announcement(self, key: Key) -> Announcer:
        """The events `key` was stored with (for its copy in a lower tier)."""

    def prepare_load(self, key: Key) -> Entry:
        """Pin the held `key` for a load (or as a write's source) until complete_load."""

    def prepare_loads(self, keys: list[Key]) -> list[Entry]: ...

    def complete_load(self, entry: Entry | None) -> None: ...

    def complete_loads(self, entries: list[Entry]) -> None: ...

    def prepare_store(self, key: Key, parent: Key | None, announce: Announcer) -> Entry | None:
        """A slot for `key` (evicting by the policy), pinned until complete_store; None: no room."""

    def prepare_stores(self, keys: list[Key], parent: Key | None, announcers: list[Announcer]) -> list[Entry]:
        """prepare_store of a run of keys, each the parent of the next (as many as fit)."""

    def complete_store(self, key: Key, ok: bool) -> None: ...

    def complete_stores(self, keys: list[Key]) -> None:
        """The stores of `keys` succeeded (one step's, in order)."""


class SecondaryTier(SchedulerTier, Protocol):
    """A tier below the CPU tier, scheduler half: loads go through a CPU slot (or, where `direct`,
    straight from an entry the workers hold open), stores come from one."""

    waits: bool  # lookups take time (prepare_lookup); False: `lookup` alone answers
    direct: bool  # the workers can load its entries straight into KV blocks (hold / ready_direct)

    def describe(self) -> str:
        """The tier in the startup log line (size, place; no credentials)."""

    def prepare_lookup(self, req_id: str, keys: list[Key]) -> bool:
        """Start or continue looking `keys` up for `req_id`; False: ask again next step (vLLM's
        LookupResult.RETRY). Called only where `waits`."""

    def busy_loading(self, key: Key) -> bool:
        """`key` is on its way into a CPU slot or being verified: its request waits a step."""

    def announcement(self, key: Key) -> Announcer | None:
        """The events `key` was stored with here (for its copy in a CPU slot), or None: the tier
        keeps none, the request's own are used."""

    def submit_load(self, key: Key, slot: int, meta: TierJobs) -> None:
        """Plan reading `key` into CPU slot `slot` (reserved by the CPU tier): a FETCH job in `meta`."""

    def submit_store(self, key: Key, parent: Key | None, end: int, announce: Announcer, slot: int,
                     meta: TierJobs) -> bool:
        """Plan writing CPU slot `slot` (`key`, whose block ends at token `end`) to the tier: a WRITE
        job in `meta`; False when the tier does not store it (held already, full, failing)."""

    def hold(self, key: Key, req_id: str) -> bool:
        """(direct tiers) Have the workers verify `key` and keep it open for `req_id` (an OPEN job)."""

    def ready_direct(self, key: Key) -> bool:
        """(direct tiers) Verified and held open: loadable straight into KV blocks."""


class SlotJobs:
    """`submit_load` and `submit_store` of a secondary tier whose loads and stores go through CPU
    slots: a FETCH job after `prefetch`, a WRITE job with what `prepare_write` says to store."""

    FETCH: TierOp
    WRITE: TierOp

    def prefetch(self, key: Key) -> None:
        """`key` is on its way into a CPU slot (busy_loading until settled)."""
        raise NotImplementedError

    def prepare_write(self, key: Key, parent: Key | None, end: int, announce: Announcer) -> bytes | None:
        """What a write of `key` stores beside its bytes (its metadata), or None: not written."""
        raise NotImplementedError

    def submit_load(self, key: Key, slot: int, meta: TierJobs) -> None:
        self.prefetch(key)
        meta.jobs.append(TierJob(self.FETCH, key, slot))

    def submit_store(self, key: Key, parent: Key | None, end: int, announce: Announcer, slot: int,
                     meta: TierJobs) -> bool:
        blob = self.prepare_write(key, parent, end, announce)
        if blob is None:
            return False
        meta.jobs.append(TierJob(self.WRITE, key, slot, blob))
        return True


class WorkerContext(Protocol):
    """What a tier's worker half gets from the worker process's side (worker.WorkerSide)."""

    layout: Layout  # as decided by the scheduler side (root, secret, rank directories)
    cfg: KVBMConfig
    rank: int
    pool: torch.Tensor | None  # the CPU tier's slots, a row each (uint8), once the KV caches are registered
    slot_bytes: int
    fingerprint: bytes | None  # of an entry's exact byte layout (a block file's or value's header)
    mac_key: np.ndarray | None  # of the tier entries' MACs (tiers/mac.mac_key), once the decision is known

    def record(self, tier: str, direction: str, blocks: int, t0: float) -> None:
        """Count `blocks` moved since perf_counter() `t0` in the stats (stats.py)."""

    def failed(self, tier: str, operation: str) -> None:
        """Count one failed operation of the tier in the stats."""


class Registered(NamedTuple):
    """What a worker half's jobs copy with: known once the KV caches are registered."""
    pool: torch.Tensor
    fingerprint: bytes
    mac_key: np.ndarray


def registered(side: WorkerContext) -> Registered:
    """The pool, fingerprint and MAC key of `side`: every job comes after register_kv_caches."""
    if side.pool is None or side.fingerprint is None or side.mac_key is None:
        raise RuntimeError("KVBMConnector: a tier job before the KV caches are registered")
    return Registered(side.pool, side.fingerprint, side.mac_key)


class WorkerTier(Protocol):
    """A tier below the CPU tier, worker half (each worker process): runs the jobs its scheduler
    half planned under its label and reports each (WRITE jobs once done, possibly steps later)."""

    label: str

    def start(self, jobs: list[TierJob]) -> None:
        """The step's OPEN and FETCH jobs, before its loads (a FETCH may finish later: the request
        waits); their CPU slots are read by no load now."""

    def close(self, keys: list[Key]) -> None:
        """Let go of entries held open (the step's CLOSE jobs, after its loads)."""

    def write(self, jobs: list[TierJob]) -> None:
        """The step's WRITE jobs, once the stores filling their slots are done."""

    def drop(self, jobs: list[TierJob]) -> None:
        """WRITE jobs not to make (a load of the step failed): each reported failed."""

    def read_held(self, key: Key, parts: list[np.ndarray]) -> bool:
        """(direct tiers) Read an entry held open into `parts` (the entry's bytes, in order),
        verified; False: it no longer verifies (a failed load)."""

    def take_reports(self) -> list[Report]:
        """Reports of the jobs finished since the last call."""

    def take_broken(self) -> bool:
        """Whether the tier failed as a whole since the last call (no more writes planned)."""

    def take_stats(self) -> dict[str, int]:
        """The tier's own counters (connector/stats.py names) since the last call, or {}."""

    def drain(self, timeout: float) -> None:
        """Finish what is queued (shutdown, tests)."""

    def shutdown(self) -> None: ...


class Series(NamedTuple):
    """A Prometheus counter fed from stats keys (what the halves' take_stats count); vLLM builds
    it in the API server process (stats.KVBMPromMetrics)."""
    name: str  # e.g. vllm:kvbm_remote_hits_total
    documentation: str
    keys: Mapping[str, tuple[str, ...]]  # stats key -> its label values
    labels: tuple[str, ...] = ()


class TierModule(NamedTuple):
    """One secondary tier: how each side builds its half (each None where the tier is not
    configured) and, optionally, how to measure its peak speeds (measure_roofline) and the
    Prometheus series of its own counters."""
    scheduler: Callable[[Layout, KVBMConfig], SecondaryTier | None]
    worker: Callable[[WorkerContext], WorkerTier | None]
    peaks: Callable[[KVBMConfig, int], dict[str, float]] | None = None  # (cfg, slot bytes) -> "<tier>_<direction>": bytes/s
    series: tuple[Series, ...] = ()
