"""What the scheduler side tells the workers each step, and what they report back.

Plain dataclasses of ints and tuples: SchedulerOutput is pickled to the workers (vLLM's choice);
nothing here defines a format of our own.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

Key = tuple[int, int]


@dataclasses.dataclass
class KVBMMetadata(KVConnectorMetadata):
    # disk -> CPU slot, verified; runs first (before loads) in start_load_kv
    prefetches: list[tuple[Key, int]] = dataclasses.field(default_factory=list)
    # CPU slot -> KV blocks, before the forward (synchronous loads). An entry of `kind` (layout.KV or
    # layout.STATE) spans the groups of that kind: one block id per group.
    loads: list[tuple[str, tuple[int, ...], int]] = dataclasses.field(default_factory=list)  # (kind, ids, slot)
    # KV blocks -> CPU slot, after the forward (wait_for_save)
    stores: list[tuple[Key, str, tuple[int, ...], int]] = dataclasses.field(default_factory=list)  # (key, kind, ids, slot)
    # CPU slot -> disk file, in the background after the stores; meta = file metadata blob
    disk_writes: list[tuple[Key, int, bytes]] = dataclasses.field(default_factory=list)
    # direct disk loads, for entries the CPU tier has no room for: `opens` verifies a block file and
    # keeps it open (first, in start_load_kv); `disk_loads` reads open files straight into KV blocks
    # (after the CPU loads); `closes` closes them (last)
    opens: list[Key] = dataclasses.field(default_factory=list)
    disk_loads: list[tuple[str, tuple[int, ...], Key]] = dataclasses.field(default_factory=list)  # (kind, ids, key)
    closes: list[Key] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclasses.dataclass
class KVBMWorkerMetadata(KVConnectorWorkerMetadata):
    stored: list[Key] = dataclasses.field(default_factory=list)
    prefetched: list[Key] = dataclasses.field(default_factory=list)
    prefetch_failed: list[Key] = dataclasses.field(default_factory=list)
    disk_written: list[Key] = dataclasses.field(default_factory=list)
    disk_failed: list[Key] = dataclasses.field(default_factory=list)
    opened: list[Key] = dataclasses.field(default_factory=list)
    open_failed: list[Key] = dataclasses.field(default_factory=list)

    def aggregate(self, other: "KVBMWorkerMetadata") -> "KVBMWorkerMetadata":
        # Concatenated; the scheduler side counts a key done once every worker reported it.
        return KVBMWorkerMetadata(*(getattr(self, f.name) + getattr(other, f.name)
                                    for f in dataclasses.fields(self)))
