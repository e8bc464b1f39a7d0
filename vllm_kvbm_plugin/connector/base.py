"""The contract of a scheduler-side tier: what SchedulerSide (scheduler.py) calls on each tier.

Modelled on vLLM's own split (vllm/v1/kv_offload): the CPU tier is the primary, the only tier
whose slots the workers copy to and from vLLM's KV blocks (`OffloadingManager`: `lookup`,
`touch`, `prepare_load` / `complete_load`, `prepare_store` / `complete_store`, `take_events`);
every tier below it (disk, remote) is a secondary (`SecondaryTierManager`): stored from a CPU
slot (`submit_store`, a write-through) and loaded into one (`submit_load`, a prefetch), its
worker I/O planned into the step's metadata and settled from the workers' reports.

SchedulerSide holds the tiers as one ordered list, primary first, fastest first: a hit is looked
up tier by tier and loaded from the first tier that holds each entry. Adding a tier is a module
with a class that fulfils `SecondaryTier` and a `create(layout, cfg)` for it in
scheduler.SECONDARY_TIERS; its worker half is its own business (worker.py for ours).
"""

from __future__ import annotations

import enum
from typing import Protocol

from vllm_kvbm_plugin.connector.block_events import Announcer
from vllm_kvbm_plugin.events.types import Tier


class Verb(enum.Enum):
    """What a worker operation did with a CPU slot, which says what the primary settles besides
    the tier named by the report (metadata.Op carries both)."""
    STORE = "store"  # KV blocks -> a CPU slot: the CPU tier's own store
    FETCH = "fetch"  # a tier -> a CPU slot, verified: completes the CPU tier's store of it
    OPEN = "open"  # a tier's entry verified and held open by the workers (direct loads)
    WRITE = "write"  # a CPU slot -> a tier: the slot, pinned as its source, is released


class TierOp(Protocol):
    """What a worker report names (metadata.Op, or a tier's own enum): which tier settles it and
    what it did with a CPU slot."""
    tier: str
    verb: Verb


class SchedulerTier(Protocol):
    """What every scheduler-side tier answers (EngineCore process; called by SchedulerSide only)."""

    label: str  # its name in reports (TierOp.tier) and in SchedulerSide.accounting()
    name: Tier  # its events' medium, locality and ownership

    def lookup(self, key) -> bool:
        """Whether `key` is held and ready to load (vLLM's LookupResult.HIT)."""

    def settle(self, op: TierOp, key, ok: bool) -> None:
        """Every worker reported `op` on `key` (ok: all of them succeeded)."""

    def release(self, req_id: str) -> None:
        """`req_id` no longer waits for what the tier keeps for its loads (planned, or gone)."""

    def on_request_finished(self, req_id: str) -> None:
        """`req_id` is gone: drop all the tier keeps for it."""

    def on_schedule_end(self, meta) -> None:
        """The step's metadata is built: add the tier's end-of-step operations to `meta`."""

    def worker_failed(self) -> None:
        """A worker's half of the tier failed as a whole (KVBMWorkerMetadata.broken)."""

    def has_pending_work(self) -> bool:
        """Operations whose reports the workers owe, or that need another step (vLLM's name)."""

    def accounting(self) -> dict:
        """What the tier holds and has in flight, merged into SchedulerSide.accounting()."""

    def take_events(self) -> list:
        """The tier's BlockStored / BlockRemoved events since the last call, in order."""


class SecondaryTier(SchedulerTier, Protocol):
    """A tier below the CPU tier: loads go through a CPU slot (or, where `direct`, straight from
    an entry the workers hold open), stores come from one."""

    waits: bool  # lookups take time (prepare_lookup); False: `lookup` alone answers
    direct: bool  # the workers can load its entries straight into KV blocks (hold / ready_direct)

    def prepare_lookup(self, req_id: str, keys: list) -> bool:
        """Start or continue looking `keys` up for `req_id`; False: ask again next step (vLLM's
        LookupResult.RETRY). Called only where `waits`."""

    def busy_loading(self, key) -> bool:
        """`key` is on its way into a CPU slot or being verified: its request waits a step."""

    def announcement(self, key) -> Announcer | None:
        """The events `key` was stored with here (for its copy in a CPU slot), or None: the tier
        keeps none, the request's own are used."""

    def submit_load(self, key, slot: int, meta) -> None:
        """Plan reading `key` into CPU slot `slot` (reserved by the CPU tier) into `meta`."""

    def submit_store(self, key, parent, end: int, announce: Announcer, slot: int, meta) -> bool:
        """Plan writing CPU slot `slot` (`key`, whose block ends at token `end`) to the tier into
        `meta`; False when the tier does not store it (held already, full, failing)."""

    def hold(self, key, req_id: str) -> bool:
        """(direct tiers) Have the workers verify `key` and keep it open for `req_id`."""

    def ready_direct(self, key) -> bool:
        """(direct tiers) Verified and held open: loadable straight into KV blocks."""
