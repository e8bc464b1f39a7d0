"""KVBMConnector, scheduler side (EngineCore): vLLM's hooks, request keys and hit planning over the
tiers (base.py: the contract; cpu_tier.py, disk_tier.py, remote_tier.py), one ordered list of them.

Per step:
- `get_num_new_matched_tokens`: find the longest prefix the tiers can restore; entries only on disk
  are first prefetched into CPU slots (the worker verifies them) and the request waits a step
  (`None`), so a load into the KV cache only ever copies verified bytes. Entries the CPU tier has
  no room for are verified the same way and kept open by the workers, then read straight into
  the KV blocks (direct disk loads), so a prefix longer than the CPU tier still comes back whole.
- `update_state_after_alloc`: turn the claim into (block ids, slot) loads; the slots stay pinned
  until the metadata is built (the worker loads before anything reuses them).
- `build_connector_meta`: store every newly completed block of the scheduled requests into CPU
  slots (and write them through to disk), evicting by the configured policy.
- `update_connector_output`: settle what every worker finished (Quorum) with the tier each report
  names; the tiers announce and remove their entries.

Hybrid models (Mamba or linear attention next to full attention, vLLM's align mode): a hit at X
tokens needs the attention KV of [0, X) and the recurrent state at X. vLLM writes the running state
of a request into the block of its last computed token at the end of every step, so the state
at X is stored right after a step that ended at X, when X is a hash-unit boundary (every physical
block boundary that ends a step, and the prompt's last unit boundary where vLLM stops a chunk).
A block that X ends inside is stored as a partial KV entry under the key of X. See docs/tiers.md.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.block_events import NOTHING, Announcer, EventBuilder, StepEvents
from vllm_kvbm_plugin.connector.base import Key, PrimaryTier, SchedulerTier, SecondaryTier, Verb
from vllm_kvbm_plugin.connector.cpu_tier import cpu_tier
from vllm_kvbm_plugin.connector.layout import KV, STATE, EntryKind, Layout, TierDecision, partial_key, state_key
from vllm_kvbm_plugin.connector.metadata import (
    DirectLoad,
    KVBMMetadata,
    KVBMWorkerMetadata,
    STORE,
    Quorum,
    copies,
)
from vllm_kvbm_plugin.connector.pic_planner import PicPlanner
from vllm_kvbm_plugin.connector.tier_modules import tier_modules
from vllm_kvbm_plugin.hashing import Keyer
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers.index import Entry

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger("connector")



@dataclasses.dataclass
class RequestKeys:
    """One live request's tier keys, owned by SchedulerSide (`requests`, EngineCore process): its
    unit keys computed so far (`unit_keys` extends them) and how far its blocks were offered to
    the tiers. Dropped when the request finishes."""

    request: Request
    unit_keys: list[Key]  # stable keys of the hash units computed so far
    stored_upto: int = 0  # blocks [0, stored_upto) were offered to the tiers


def unit_keys(st: RequestKeys, n_units: int, unit: int, root: Key, pool: BlockPool | None,
              keyer: Keyer) -> list[Key]:
    """Stable keys of the request's first n_units hash units (computed once, extended), with
    vLLM's extra keys (images, LoRA, salt) folded in as vLLM computes them (`pool`). Extended
    to every full unit of the request at once: one kernel call, not one per block of a hit."""
    have = len(st.unit_keys)
    if n_units > have:
        req = st.request
        n_units = max(n_units, len(req.all_token_ids) // unit)
        tokens = req.all_token_ids[have * unit : n_units * unit]
        extras = None
        if compat.has_extra_keys(req):
            extras = {}
            for u in compat.units_with_extra_keys(req, unit, have, n_units):
                keys, _ = compat.block_extra_keys(pool, req, u * unit, (u + 1) * unit, 0)
                if keys:
                    extras[u - have] = keyer.extra_hash(keys)
        parent = st.unit_keys[-1] if have else root
        new = keyer.request_keys(tokens, unit, parent, extras)
        st.unit_keys += map(tuple, new.tolist())  # (int, int): hashable tier keys
    return st.unit_keys


@dataclasses.dataclass(slots=True)
class _Need:
    """One tier entry a hit needs: where it goes in the request's blocks."""
    key: Key
    kind: EntryKind
    index: int  # KV: block index; STATE: the hit's token count
    direct: str | None = None  # the label of the tier whose workers hold it open for a direct load; None: from a CPU slot
    entry: Entry | None = None  # else the CPU tier's entry, pinned for this load


@dataclasses.dataclass
class _Claim:
    computed: int  # tokens vLLM had before the hit
    tokens: int  # tokens claimed
    needs: list
    load_async: bool = False  # loaded while the request waits a step (see _exact_hit)


class SchedulerSide:
    """KVBMConnector's scheduler half, in the EngineCore process (KVBMConnector delegates vLLM's
    scheduler-side hooks to it). Owns the tiers (`tiers`: the CPU tier, `primary`, then the
    secondaries of tier_modules), each request's keys, the hits claimed and not yet loaded,
    the step's metadata for the workers, the count of their reports, and the event builder."""

    def __init__(self, layout: Layout, cfg: KVBMConfig) -> None:
        self.layout = layout
        self.cfg = cfg
        self.block_size, self.hash_unit = layout.block_size, layout.hash_unit
        self.pic = PicPlanner.create(layout, cfg)  # position-independent loads (pic_planner.py), or None
        # the CPU tier: every load into the KV cache comes from its slots (or a held file), every
        # store goes to them first, every other tier loads into them and stores from them
        self.primary: PrimaryTier = self.pic.cpu if self.pic is not None else cpu_tier(layout, cfg.eviction_policy)
        self.lower: list[SecondaryTier] = [t for t in (m.scheduler(layout, cfg) for m in tier_modules(cfg))
                                           if t is not None]
        self.tiers: list[SchedulerTier] = [self.primary, *self.lower]
        self._by_label = {t.label: t for t in self.tiers}
        self._waiting = [(i + 1, t) for i, t in enumerate(self.lower) if t.waits]  # (position, tier)
        self._direct = [t for t in self.lower if t.direct]
        self.quorum = Quorum(layout.world)
        self.events = EventBuilder(layout)
        self.requests: dict[str, RequestKeys] = {}
        self.claims: dict[str, _Claim] = {}
        self.state_loads: dict[str, tuple[int, tuple[str | None, Key | int]]] = {}  # req id -> (hit tokens, source): see _load_state
        self.meta = KVBMMetadata()
        self.store_keys: list[Key] = []  # the keys of this step's stores (meta.stores), in order
        self.store_batches: dict[int, list[Key]] = {}  # store_batch -> its keys, until the workers report it
        self.batch_numbers = itertools.count(1)
        self.loads_pinned: list[Entry] = []  # the CPU entries this step loads from
        self.write_sources: dict[tuple[str, Key], Entry] = {}  # (tier label, key) -> the CPU entry it is written from
        self.kv_cache_manager: KVCacheManager | None = None  # bound later (block ids of the requests)
        self.decision: TierDecision | None = layout.decision()  # sent to the workers with the first step, then None
        self.several_groups = len(layout.layer_names) > 1
        # numba loads the key kernels from its cache at their first call (~0.7 s here): at startup,
        # not in the first request's scheduler step
        if layout.keyer is not None:
            layout.keyer.request_keys([0] * self.hash_unit, self.hash_unit, layout.decided_root())
        logger.info(
            "KVBMConnector: CPU tier %d slots of %d bytes (%.1f MiB), %s, eviction %s%s; block-key "
            "secret from %s, followed by every worker",
            layout.cpu_slots, layout.slot_bytes, layout.cpu_slots * layout.slot_bytes / 2**20,
            ", ".join(t.describe() for t in self.lower) or "no tier below it",
            cfg.eviction_policy,
            f", hybrid: state groups {list(layout.groups[STATE])}, hits every {self.hash_unit} tokens"
            if layout.hybrid else "",
            layout.secret_source or "the test's layout",
        )

    def tier(self, label: str) -> SchedulerTier | None:
        """The tier of that label ("cpu", "disk", "remote", ...), or None (not configured): how
        stats, tests and tools find one tier (the planner goes through `tiers`)."""
        return self._by_label.get(label)

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.events.pool = kv_cache_manager.block_pool

    @property
    def pool(self) -> BlockPool | None:
        return self.events.pool

    def _manager(self) -> KVCacheManager:
        """vLLM's KV cache manager (bind): the requests' block ids."""
        if self.kv_cache_manager is None:
            raise RuntimeError("KVBMConnector: the scheduler side is used before vLLM bound its KV cache manager")
        return self.kv_cache_manager

    def accounting(self) -> dict[str, object]:
        """What is in flight: all zeros when idle (tests check that nothing leaks)."""
        out: dict[str, object] = {"prefetching": 0, "direct": 0}  # entries read into CPU slots, held open for direct loads
        for t in self.tiers:
            out.update(t.accounting())
        out["reports_pending"] = len(self.quorum.pending)
        return out

    def has_pending_push_work(self) -> bool:
        """Whether work is in flight that completes by itself and then needs an engine step to be
        settled and announced: stores, disk writes, prefetches, remote fetches and writes whose
        reports the workers owe (every worker's, `quorum`), and files to close. vLLM's engine
        core keeps stepping while this holds (Scheduler.has_requests), so a write that ends after
        the last request is announced then, not when the next request comes (or never).

        Entries pinned for a running or waiting request, and what the tiers merely hold, are no
        such work: an idle engine would spin. Called every loop iteration of an idle engine core,
        so only emptiness checks (and the few files held open)."""
        if self.quorum.pending:
            return True
        for t in self.tiers:
            if t.has_pending_work():
                return True
        return False

    # ---- keys --------------------------------------------------------------------------------
    def _keys(self, request: Request) -> RequestKeys:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = RequestKeys(request, [])
        return st

    def _unit_keys(self, st: RequestKeys, n_units: int) -> list[Key]:
        keyer = self.layout.keyer
        if keyer is None:
            raise RuntimeError("KVBMConnector: the scheduler side's layout has no Keyer (Layout.from_vllm decides it)")
        return unit_keys(st, n_units, self.hash_unit, self.layout.decided_root(), self.pool, keyer)

    def _keys_upto(self, st: RequestKeys, n_units: int) -> list[Key]:
        """The request's unit keys, at least `n_units` of them (computed once per request: the hot
        loops call this per step, so the usual case makes no further call)."""
        keys = st.unit_keys
        return keys if len(keys) >= n_units else self._unit_keys(st, n_units)

    def _block_key(self, st: RequestKeys, i: int) -> Key:
        """Key of block i: the key of its last unit."""
        u = (i + 1) * self.layout.units_per_block
        return self._keys_upto(st, u)[u - 1]

    # ---- hits --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        hit, is_async = self._exact_hit(request, num_computed_tokens)
        if self.pic is not None and hit is not None:  # opted-in requests: runs that continue the hit
            hit += self.pic.extend(request, num_computed_tokens, hit, request.num_tokens - 1)
        return hit, is_async

    def _exact_hit(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        start = num_computed_tokens // self.block_size
        limit = request.num_tokens - 1  # vLLM must compute at least one token
        st = self._keys(request)
        for position, tier in self._waiting:
            if not tier.prepare_lookup(request.request_id, self._candidates(st, start, limit, position)):
                return None, False  # its lookup is still running: wait a step
        plan = self._plan(st, start, limit, self._held if self.lower else self.primary.lookup)
        if plan is None:
            self._release_claim(request.request_id)
            return 0, False
        cpu = self.primary
        if self.lower and any(self._busy_loading(n.key) for n in plan[1]):
            return None, False  # their verification is still running
        elsewhere = [n for n in plan[1] if not self._loadable(n.key)]  # in a lower tier only
        if elsewhere:
            # a prefetch may evict CPU entries, but none this hit needs
            in_cpu = cpu.prepare_loads([n.key for n in plan[1] if cpu.lookup(n.key)])
            rest = self._prefetch(st, elsewhere)
            issued = len(elsewhere) - len(rest)
            for n in rest:  # direct loads: from tiers whose workers hold entries open (disk)
                holder = next((t for t in self._direct if t.lookup(n.key)), None)
                if holder is None or not holder.hold(n.key, request.request_id):
                    break
                issued += 1
            cpu.complete_loads(in_cpu)
            if issued:
                return None, False  # come back once the entries are verified
            plan = self._plan(st, start, limit, self._loadable)  # what can be loaded now
        self._release_claim(request.request_id)
        if plan is None:
            return 0, False
        tokens, needs = plan
        # nothing may evict a claimed entry or close its file before its load has run
        for n in needs if self._direct else ():
            if not cpu.lookup(n.key):
                tier = next(t for t in self._direct if t.ready_direct(n.key))
                tier.hold(n.key, request.request_id)
                n.direct = tier.label
        from_cpu = [n for n in needs if not n.direct]
        for n, entry in zip(from_cpu, cpu.prepare_loads([n.key for n in from_cpu])):
            n.entry = entry
        # A direct load can fail (a file changed in place after its verification). vLLM takes
        # block-level load errors for one KV cache group only; with several, only a request's
        # asynchronous load can fail as a whole (failed_recving): such a hit waits a step for it.
        load_async = self.several_groups and any(n.direct for n in needs)
        self.claims[request.request_id] = _Claim(num_computed_tokens, tokens - num_computed_tokens, needs, load_async)
        return tokens - num_computed_tokens, load_async

    def _held(self, key: Key) -> bool:
        if self.primary.lookup(key):
            return True
        for t in self.lower:
            if t.lookup(key):
                return True
        return False

    def _busy_loading(self, key: Key) -> bool:
        for t in self.lower:
            if t.busy_loading(key):
                return True
        return False

    def _candidates(self, st: RequestKeys, start: int, limit: int, position: int) -> list[Key]:
        """The keys a hit past block `start` could need that the tiers before `position` do not
        hold: what the tier at `position` is asked for."""
        B, r, unit = self.block_size, self.layout.units_per_block, self.hash_unit
        ends = limit // B if self.layout.hybrid else (limit + 1) // B  # _plan: a last block ending at token `limit`
        keys = [self._block_key(st, i) for i in range(start, ends)]
        if self.layout.hybrid:
            units = self._unit_keys(st, limit // unit)
            for u in range(start * r + 1, limit // unit + 1):
                keys += [state_key(units[u - 1]), partial_key(units[u - 1])]
        before = self.tiers[:position]
        return [k for k in keys if not any(t.lookup(k) for t in before)]

    def _loadable(self, key: Key) -> bool:
        """In a CPU slot, or verified and held open for a direct load."""
        if self.primary.lookup(key):
            return True
        for t in self._direct:
            if t.ready_direct(key):
                return True
        return False

    def _plan(self, st: RequestKeys, start: int, limit: int,
              held: Callable[[Key], bool]) -> tuple[int, list[_Need]] | None:
        """The longest hit past block `start` (tokens, entries it needs) whose entries all pass
        `held`, or None. A hit never covers token `limit`."""
        B, r = self.block_size, self.layout.units_per_block
        n = (limit + 1) // B  # blocks a hit could cover
        keys = self._keys_upto(st, n * r)
        full = start  # blocks [start, full) are held
        while (full + 1) * B <= limit and held(keys[(full + 1) * r - 1]):
            full += 1
        if not self.layout.hybrid:
            hit = full * B
            if (full + 1) * B == limit + 1 and held(keys[(full + 1) * r - 1]):
                full, hit = full + 1, limit  # the last block whole: vLLM computes only its last token
            return (hit, [_Need(keys[(i + 1) * r - 1], KV, i) for i in range(start, full)]) if full > start else None
        unit = self.hash_unit
        keys = self._unit_keys(st, limit // unit)
        # the hit ends after unit u-1: X = u * unit, inside or at the end of block u // r <= full
        for u in range(min(limit // unit, (full + 1) * r - 1), start * r, -1):
            x, nb = u * unit, u // r
            if not held(state_key(keys[u - 1])):
                continue
            needs = [_Need(self._block_key(st, i), KV, i) for i in range(start, nb)]
            if x % B:  # X ends inside block nb: a partial entry, or the whole block if held
                if held(partial_key(keys[u - 1])):
                    needs.append(_Need(partial_key(keys[u - 1]), KV, nb))
                elif nb < full:
                    needs.append(_Need(self._block_key(st, nb), KV, nb))
                else:
                    continue
            needs.append(_Need(state_key(keys[u - 1]), STATE, x))
            return x, needs
        return None

    def _release_claim(self, req_id: str) -> None:
        claim = self.claims.pop(req_id, None)
        for n in claim.needs if claim else ():
            self.primary.complete_load(n.entry)  # None: a direct load's

    def _prefetch(self, st: RequestKeys, needs: list[_Need]) -> list[_Need]:
        """Read entries of the lower tiers into CPU slots, in order, while the CPU tier has room and
        holds the block each one extends (so the CPU medium stays prefix-closed, as stores keep it:
        a router never sees a CPU block without its parent); returns the needs left for direct loads."""
        B, cpu = self.block_size, self.primary
        for i, n in enumerate(needs):
            before = n.index - 1 if n.kind == KV else n.index // B - 1  # the block this entry extends
            parent = self._block_key(st, before) if before >= 0 else None
            if parent is not None and parent not in cpu:
                return needs[i:]
            source = next((t for t in self.lower if t.lookup(n.key)), self.lower[-1])
            announce = source.announcement(n.key) or self._announcer(st, n)
            entry = cpu.prepare_store(n.key, parent, announce)
            if entry is None:
                return needs[i:]
            if self.pic is not None and n.kind == KV:
                self.pic.stored(st.request, n.index, n.key, parent)
            source.submit_load(n.key, entry.slot, self.meta)
        return []

    def _announcer(self, st: RequestKeys, n: _Need) -> Announcer:
        """The CPU tier's events of an entry read from a tier that keeps none, built from the request."""
        B, req = self.block_size, st.request
        if n.kind == STATE:
            x = n.index
            return self.events.announcer(req, x - (self.hash_unit if x % B else B), x, STATE)
        if (n.index + 1) * B > req.num_tokens or n.key != self._block_key(st, n.index):
            return NOTHING  # a partial block (hybrid): internal
        return self.events.announcer(req, n.index * B, (n.index + 1) * B, KV)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.pic is not None:
            self.pic.after_alloc(request, blocks, num_external_tokens, self.meta, self.loads_pinned)
        claim = self.claims.pop(request.request_id, None)
        if claim is None:
            return
        hybrid = self.layout.hybrid
        if hybrid and 0 < num_external_tokens != claim.tokens:
            # the state at the claimed end cannot be cut shorter; no vLLM path does this today
            logger.error("KVBMConnector: vLLM took %d of the %d tokens claimed for request %s; "
                         "nothing is loaded", num_external_tokens, claim.tokens, request.request_id)
            num_external_tokens = 0
        end = claim.computed + max(num_external_tokens, 0)
        block_ids = blocks.get_block_ids()
        kv_ids = [block_ids[g] for g in self.layout.groups[KV]]
        B = self.block_size
        unwanted, kv_loads, state = [], [], []  # from CPU slots: entries not loaded, KV needs loaded, the state's need
        for n in claim.needs:
            if n.kind is STATE:
                wanted = num_external_tokens > 0
            else:  # a whole block, or the partial block a hybrid hit ends inside
                wanted = n.index * B < end or (hybrid and num_external_tokens > 0)
            if not wanted:
                if not n.direct:
                    unwanted.append(n.entry)
            elif n.kind is STATE:  # from a held file (open until the metadata is built) or a slot
                source = (n.direct, n.key if n.direct else n.entry.slot)
                if claim.load_async:  # where the request's first step finds it (vLLM copies it on)
                    self._load_state_at(request.request_id, source, [(n.index - 1) // B], block_ids, True)
                else:
                    self.state_loads[request.request_id] = (n.index, source)
                if not n.direct:
                    state.append(n)
            elif n.direct:
                self._add_load(KV, tuple(ids[n.index] for ids in kv_ids), n.direct, n.key,
                               request.request_id if claim.load_async else None)
            else:
                kv_loads.append(n)
        if kv_loads:
            loads = copies(self.meta.loads, KV, len(kv_ids))
            for column, ids in zip(loads.block_ids, kv_ids):
                column += [ids[n.index] for n in kv_loads]
            loads.slots.extend([n.entry.slot for n in kv_loads])
        loaded = kv_loads + state  # the needs' order: the state comes last
        self.primary.complete_loads(unwanted)
        self.primary.touch_all([n.key for n in loaded])
        self.loads_pinned += [n.entry for n in loaded]  # unpinned once the metadata is built
        if claim.load_async and num_external_tokens > 0:
            self.meta.recving.append(request.request_id)
        for t in self.lower:  # the files this request held open stay open only for the loads just planned
            t.release(request.request_id)

    def _add_load(self, kind: EntryKind, ids: tuple[int, ...], direct: str | None, source: Key | int,
                  request: str | None = None) -> None:
        """A load of `ids` from CPU slot `source`, or (`direct`: the tier's label) from the entry
        `source` that tier's workers hold open."""
        if direct:
            assert not isinstance(source, int)  # a key
            self.meta.direct_loads.append(DirectLoad(kind, ids, source, direct, request))
        else:
            assert isinstance(source, int)  # a slot
            copies(self.meta.loads, kind, len(ids)).add(ids, source)

    def _load_state(self, req_id: str, scheduled: int) -> None:
        """Load a hit's recurrent state into the block vLLM reads it from, (X-1)//B, and into the
        block this step's state goes to: vLLM copies the first into the second before the
        forward but after nothing of ours ran (preprocess_mamba precedes start_load_kv)."""
        pending = self.state_loads.pop(req_id, None)
        if pending is None:
            return
        x, source = pending
        B = self.block_size
        self._load_state_at(req_id, source, sorted({(x - 1) // B, (x + scheduled + B - 1) // B - 1}),
                            self._manager().get_block_ids(req_id))

    def _load_state_at(self, req_id: str, source: tuple[str | None, Key | int], indices: list[int],
                       block_ids: tuple[list[int], ...],
                       load_async: bool = False) -> None:
        """The state at X from `source` ((direct tier label or None, key or slot)) into the request's state blocks `indices`."""
        direct, where = source
        null = self._manager().block_pool.null_block.block_id
        for index in indices:
            ids = tuple(block_ids[g][index] for g in self.layout.groups[STATE])
            if null in ids:
                logger.error("KVBMConnector: request %s has no state block at index %d", req_id, index)
                continue
            self._add_load(STATE, ids, direct, where, req_id if load_async else None)

    def _pic_step(self, req_id: str, computed: int, scheduled: int, scheduler_output: SchedulerOutput) -> int:
        """Position-independent loads of this step (pic_planner.py); returns the step's tokens,
        fewer when the prefill skips a loaded run past a gap."""
        if self.pic is not None and req_id in self.pic.blending:
            self.pic.step_loads(req_id, computed, scheduled, self._manager().get_block_ids(req_id),
                                self.meta, self.loads_pinned)
        if self.pic is not None and req_id in self.pic.skipping:
            scheduled = self.pic.skip(req_id, computed, scheduler_output, self._manager().get_block_ids(req_id),
                                      self.meta, self.loads_pinned)
        return scheduled

    # ---- stores ------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVBMMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            scheduled = scheduler_output.num_scheduled_tokens[new.req_id]
            self._load_state(new.req_id, scheduled)
            scheduled = self._pic_step(new.req_id, new.num_computed_tokens, scheduled, scheduler_output)
            self._store(new.req_id, new.num_computed_tokens + scheduled, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            scheduled = scheduler_output.num_scheduled_tokens[req_id]
            self._load_state(req_id, scheduled)  # resumed requests
            scheduled = self._pic_step(req_id, cached.num_computed_tokens[i], scheduled,
                                       scheduler_output)  # later chunks of a prefill
            self._store(req_id, cached.num_computed_tokens[i] + scheduled, scheduler_output)
        self.primary.complete_loads(self.loads_pinned)
        self.loads_pinned = []
        for req_id in list(self.claims):  # claimed, but vLLM could not allocate: no load
            self._release_claim(req_id)
        if self.pic is not None:
            self.pic.release_all()
            self.pic.ensure_loads_before_forward(scheduler_output, self.meta)
        self.state_loads.clear()
        meta, self.meta = self.meta, KVBMMetadata()
        if self.decision is not None:
            meta.decision, self.decision = self.decision, None
        if meta.stores:
            meta.store_batch = next(self.batch_numbers)
            self.store_batches[meta.store_batch], self.store_keys = self.store_keys, []
        for t in self.tiers:
            t.on_schedule_end(meta)
        return meta

    def _store(self, req_id: str, computed_after_step: int, scheduler_output: SchedulerOutput) -> None:
        st = self.requests.get(req_id)
        if st is None:
            return
        req = st.request
        B = self.block_size
        prompt_only = self.cfg.offload_prompt_only
        n_full = computed_after_step // B
        if prompt_only:
            n_full = min(n_full, req.num_prompt_tokens // B)
        if self.pic is not None and (exact := self.pic.exact_tokens(req_id)) is not None:
            n_full = min(n_full, exact // B)  # approximate KV is never stored under exact keys
        i = st.stored_upto
        if i < n_full:
            r = self.layout.units_per_block
            keys = self._keys_upto(st, n_full * r)
            parent = keys[i * r - 1] if i else None
            # a tier holds whole prefixes: no block without its parent; each block's parent is the
            # block before it, which is stored or found held here (pinned while its child is stored)
            if parent is None or parent in self.primary.entries:
                i = self._store_blocks(st, i, keys[(i + 1) * r - 1 : n_full * r : r], parent)
            st.stored_upto = max(st.stored_upto, i)
        x = computed_after_step
        if (self.layout.hybrid and x % self.hash_unit == 0 and x >= self.hash_unit
                and (x % B == 0 or x <= req.num_prompt_tokens) and not (prompt_only and x > req.num_prompt_tokens)
                and not scheduler_output.scheduled_spec_decode_tokens.get(req_id)):
            self._store_state(st, x)

    def _store_blocks(self, st: RequestKeys, first: int, keys: list[Key], parent: Key | None) -> int:
        """Store the request's whole blocks first, first + 1, ... (`keys`, the first under `parent`)
        in the CPU tier (and write them through): a run of blocks the tier holds already is
        touched (and written through), a run of new ones reserved in one call while the tier has
        free slots; once it needs evictions, block by block (`_store_each`). Returns the block
        after the last one stored or found held."""
        cpu, lower = self.primary, self.lower
        held = cpu.entries
        run = self.events.step_events(st.request, first)  # the events of the blocks stored here, built together once announced
        n, m = len(keys), 0
        while m < n:
            j = m + 1
            if keys[m] in held:
                while j < n and keys[j] in held:
                    j += 1
                cpu.touch_all(keys[m:j])
                if lower:
                    for b, k in enumerate(keys[m:j], first + m):
                        self._write_through(k, parent, (b + 1) * self.block_size, run.announcer(b))
                        parent = k
            else:
                while j < n and keys[j] not in held:
                    j += 1
                new = keys[m:j]
                announcers = run.announcers(first + m, j - m)
                made = cpu.prepare_stores(new, parent, announcers)
                if made:
                    self._planned_stores(st, first + m, new, made, parent, announcers)
                if len(made) < j - m:  # the rest needs evictions
                    m += len(made)
                    return self._store_each(st, first, keys, m, keys[m - 1] if made else parent, run)
            parent = keys[j - 1]
            m = j
        return first + n

    def _planned_stores(self, st: RequestKeys, first: int, keys: list[Key], made: list[Entry], parent: Key | None,
                        announcers: list[Announcer]) -> None:
        """The stores (and pic index entries, write-throughs) of the blocks first, ...
        whose CPU entries `made` were just reserved under `keys`."""
        req = st.request
        block_ids = self._manager().get_block_ids(req.request_id)
        groups = self.layout.groups[KV]
        n = len(made)
        stores = copies(self.meta.stores, KV, len(groups))
        for column, g in zip(stores.block_ids, groups):
            column += block_ids[g][first : first + n]
        stores.slots.extend([e.slot for e in made])
        self.store_keys += keys[:n] if len(keys) != n else keys
        blocks = range(first, first + n)
        pic = self.pic if self.pic is not None and self.pic.indexing else None
        if pic is None and not self.lower:
            return
        B = self.block_size
        for k, b, announce in zip(keys, blocks, announcers):
            if pic is not None:
                pic.stored(req, b, k, parent)
            if self.lower:
                self._write_through(k, parent, (b + 1) * B, announce)
            parent = k

    def _store_each(self, st: RequestKeys, first: int, keys: list[Key], m: int, parent: Key | None,
                    run: StepEvents) -> int:
        """_store_blocks from keys[m] on, block by block: a store may evict, even a block this
        request goes on to, so each block is looked up when its turn comes."""
        cpu = self.primary
        held = cpu.entries
        while m < len(keys):
            b, k = first + m, keys[m]
            if k in held:
                cpu.touch(k)
                if self.lower:
                    self._write_through(k, parent, (b + 1) * self.block_size, run.announcer(b))
            else:
                announce = run.announcer(b)
                entry = cpu.prepare_store(k, parent, announce)
                if entry is None:
                    break
                self._planned_stores(st, b, [k], [entry], parent, [announce])
            parent = k
            m += 1
        return first + m

    def _store_state(self, st: RequestKeys, x: int) -> None:
        """The recurrent state at x (and the KV block x ends inside), right after the step that
        ended at x wrote it."""
        B, req = self.block_size, st.request
        nb = x // B
        parent = self._block_key(st, nb - 1) if nb else None
        if parent is not None and parent not in self.primary:
            return  # useless without every block before it
        block_ids = self._manager().get_block_ids(req.request_id)
        unit_key = self._unit_keys(st, x // self.hash_unit)[x // self.hash_unit - 1]
        # the state's events mirror vLLM's: a whole block at block ends, else the last hash unit
        first = x - (self.hash_unit if x % B else B)
        entries = [(state_key(unit_key), STATE, (x - 1) // B, self.events.announcer(req, first, x, STATE))]
        if x % B:
            entries.append((partial_key(unit_key), KV, nb, NOTHING))
        null = self._manager().block_pool.null_block.block_id
        for k, kind, index, announce in entries:
            ids = tuple(block_ids[g][index] for g in self.layout.groups[kind])
            if null in ids:
                return
            if k not in self.primary:
                entry = self.primary.prepare_store(k, parent, announce)
                if entry is None:
                    return
                copies(self.meta.stores, kind, len(ids)).add(ids, entry.slot)
                self.store_keys.append(k)
            else:
                self.primary.touch(k)
            self._write_through(k, parent, x, announce)

    def _write_through(self, key: Key, parent: Key | None, end: int, announce: Announcer) -> None:
        """Store the CPU tier's `key` in every lower tier that takes it, written behind from its slot."""
        if not self.lower:
            return
        cpu = self.primary
        slot = cpu.slot(key)
        for t in self.lower:
            if t.submit_store(key, parent, end, announce, slot, self.meta):
                # the slot is the source of the write: its entry is pinned until the write is reported
                self.write_sources[t.label, key] = cpu.prepare_load(key)

    # ---- worker reports ----------------------------------------------------------------------
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if self.pic is not None:
            self.pic.flush()
        wm: KVBMWorkerMetadata | None = getattr(output, "kv_connector_worker_meta", None)
        if not wm:
            return
        cpu, by_label, quorum = self.primary, self._by_label, self.quorum
        for report in wm.reports:
            op, key = report.op, report.key
            ok = quorum.add(report)
            if ok is None:
                continue  # other workers have yet to report
            if op == STORE:  # a step's stores, settled in one call in the order they were made
                assert isinstance(key, int)  # the store batch
                keys = self.store_batches.pop(key, [])
                if ok:
                    cpu.complete_stores(keys)
                else:
                    for k in keys:
                        cpu.complete_store(k, False)
                continue
            verb = op.verb
            assert not isinstance(key, int)  # an entry's key
            if verb is Verb.WRITE:
                cpu.complete_load(self.write_sources.pop((op.tier, key), None))  # the write's source slot
            by_label[op.tier].settle(op, key, ok)
            if verb is Verb.FETCH:
                cpu.settle(op, key, ok)  # the slot it was read into
        for label in wm.broken:
            tier = by_label.get(label)
            if tier is not None:
                tier.worker_failed()

    def request_finished(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self._release_claim(request.request_id)
        if self.pic is not None:
            self.pic.release(request.request_id, finished=True)
        for t in self.lower:
            t.on_request_finished(request.request_id)

    def take_stats(self) -> dict[str, int]:
        """The tiers' own counters and the position-independent planner's (what only the
        scheduler side counts) since the last call."""
        out: dict[str, int] = {}
        for t in self.tiers:
            out.update(t.take_stats())
        if self.pic is not None:
            out.update(self.pic.take_counts())
        return out

    def take_events(self) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        for t in self.tiers:
            events += t.take_events()
        return events
