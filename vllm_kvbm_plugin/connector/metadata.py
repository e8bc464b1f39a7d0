"""What the scheduler side tells the workers each step, and what they report back.

Named tuples of ints: SchedulerOutput is pickled to the workers (vLLM's choice); nothing here
defines a format of our own. The tiers below the CPU tier all speak one message, the `TierJob`
(base.py), whatever the tier; what is here besides is the CPU tier's and the loads'. An entry of a `kind` (layout.EntryKind)
spans the groups of that kind: one block id per group. The copies between KV blocks and CPU slots,
one per block, are columns of ints (`Copies`), not a tuple per block: the engine core pickles
them every step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_kvbm_plugin.connector.base import Key, Report, TierJob, TierOp, Verb
from vllm_kvbm_plugin.connector.layout import EntryKind, TierDecision


class Copies(NamedTuple):
    """A step's copies of one entry kind between KV blocks and CPU slots: entry i is the blocks
    block_ids[g][i] of the kind's groups g and the slot slots[i]. Loads (slot -> blocks) run
    before the forward, stores (blocks -> slot) after it."""
    kind: EntryKind
    block_ids: tuple[list[int], ...]  # one column per group of the kind
    slots: list[int]

    def add(self, ids: tuple[int, ...], slot: int) -> None:
        for column, i in zip(self.block_ids, ids):
            column.append(i)
        self.slots.append(slot)


def copies(table: dict[EntryKind, Copies], kind: EntryKind, groups: int) -> Copies:
    """The Copies of `kind` in `table` (KVBMMetadata.loads or .stores), empty at first."""
    c = table.get(kind)
    if c is None:
        c = table[kind] = Copies(kind, tuple([] for _ in range(groups)), [])
    return c


def copy_ops(table: dict[EntryKind, Copies]) -> Iterator[tuple[EntryKind, tuple[int, ...], int]]:
    """The (kind, block id per group, slot) of every entry of `table`: TransferEngine.submit's ops."""
    return itertools.chain.from_iterable(zip(itertools.repeat(c.kind), zip(*c.block_ids), c.slots)
                                         for c in table.values())


def copy_count(table: dict[EntryKind, Copies]) -> int:
    """The entries of `table` (for the stats)."""
    return sum(len(c.slots) for c in table.values())


class DirectLoad(NamedTuple):
    """An entry the workers of tier `tier` hold open, verified -> KV blocks (entries the CPU tier
    has no room for). `request`: the request it loads for when that request's load is asynchronous
    (KVBMMetadata.recving)."""
    kind: EntryKind
    block_ids: tuple[int, ...]
    key: Key
    tier: str
    request: str | None = None


class PicLoad(NamedTuple):
    """Tokens [src_offset, +count) of a CPU slot -> tokens [dst_offset, +count) of KV blocks, K
    re-rotated from positions old_position.. to new_position.. (connector/pic_load.py)."""
    block_ids: tuple[int, ...]
    dst_offset: int
    slot: int
    src_offset: int
    count: int  # type: ignore[assignment]  # shadows tuple.count, which nothing calls on a PicLoad
    old_position: int
    new_position: int


@dataclasses.dataclass
class KVBMMetadata(KVConnectorMetadata):
    """One step's work for every worker: built by SchedulerSide.build_connector_meta in EngineCore,
    sent by vLLM with the scheduler output to each worker process, where WorkerSide runs it
    (start_load_kv before the forward, wait_for_save after)."""

    # start_load_kv runs, in order: the tiers' OPEN and FETCH jobs, loads, direct loads,
    # position-independent loads, the tiers' CLOSE jobs; wait_for_save runs the stores, then
    # queues the tiers' WRITE jobs (they read the slots the stores fill)
    jobs: list[TierJob] = dataclasses.field(default_factory=list)
    loads: dict[EntryKind, Copies] = dataclasses.field(default_factory=dict)
    direct_loads: list[DirectLoad] = dataclasses.field(default_factory=list)
    pic_loads: list[PicLoad] = dataclasses.field(default_factory=list)
    # req id -> (its tokens after the step, ((start, count), ...) computed): loaded runs between
    # them (patches/pic_segments.py computes them in one forward)
    pic_queries: dict[str, tuple[int, tuple[tuple[int, int], ...]]] = dataclasses.field(default_factory=dict)
    # the stores succeed or fail together: reported once, Report(STORE, store_batch, ok); the
    # scheduler side keeps their keys
    stores: dict[EntryKind, Copies] = dataclasses.field(default_factory=dict)
    store_batch: int = 0
    # requests whose loads above are asynchronous (hybrid hits with direct loads: vLLM takes a failed
    # load of a model with several KV cache groups per request only): each worker reports them
    # received, or failed, through vLLM's get_transfer_results
    recving: list[str] = dataclasses.field(default_factory=list)
    # the first step's only: what every worker follows (WorkerSide.follow), before anything above
    decision: TierDecision | None = None

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in dataclasses.fields(self))


STORE = TierOp("cpu", Verb.STORE)  # a step's stores into CPU slots (one report per step and worker)


@dataclasses.dataclass
class KVBMWorkerMetadata(KVConnectorWorkerMetadata):
    """What one step's workers report back: built by WorkerSide.build_worker_meta in each worker
    process, aggregated by vLLM, read by SchedulerSide.update_connector_output in EngineCore."""

    reports: list[Report] = dataclasses.field(default_factory=list)
    broken: tuple[str, ...] = ()  # tiers (labels) whose worker half failed as a whole: no more writes

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVBMWorkerMetadata:
        # Concatenated: the scheduler side decides once every worker reported (Quorum).
        assert isinstance(other, KVBMWorkerMetadata)  # every worker's is ours
        return KVBMWorkerMetadata(self.reports + other.reports,
                                  self.broken + tuple(t for t in other.broken if t not in self.broken))


class Quorum:
    """SchedulerSide's count of the workers' reports (EngineCore process). The outcome of each (operation, key) once every worker reported it: ok only if all did.

    Waiting for every report (instead of deciding at the first failure) means a late report of a
    worker can never count towards the next time the same operation runs on the same key."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.pending: dict[tuple[TierOp, Key | int], list[int]] = {}  # -> [reports, successes]

    def add(self, report: Report) -> bool | None:
        """True / False once all workers reported (`report` was the last), else None."""
        if self.world == 1:  # one worker: its report decides
            return report.ok
        op_key = (report.op, report.key)
        counts = self.pending.setdefault(op_key, [0, 0])
        counts[0] += 1
        counts[1] += report.ok
        if counts[0] < self.world:
            return None
        del self.pending[op_key]
        return counts[1] == self.world
