"""KVBMConnector, scheduler side (EngineCore): the tier indexes, load and store decisions, events.

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
- `update_connector_output`: mark what the workers finished; announce and remove tier entries.

Hybrid models (Mamba or linear attention next to full attention, vLLM's align mode): a hit at X
tokens needs the attention KV of [0, X) and the recurrent state at X. vLLM writes the running state
of a request into the block of its last computed token at the end of every step, so the state
at X is stored right after a step that ended at X, when X is a hash-unit boundary (every physical
block boundary that ends a step, and the prompt's last unit boundary where vLLM stops a chunk).
A block that X ends inside is stored as a partial KV entry under the key of X. See docs/tiers.md.
"""

from __future__ import annotations

import dataclasses
import os
import resource
from collections import Counter

import msgspec

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import to_event_extra_keys

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.metadata import KVBMMetadata, KVBMWorkerMetadata
from vllm_kvbm_plugin.connector.layout import (
    KV,
    STATE,
    entry_groups,
    key_root,
    partial_key,
    rank_dir,
    slot_bytes,
    state_key,
)
from vllm_kvbm_plugin.events.types import MEDIUM_CPU, MEDIUM_DISK
from vllm_kvbm_plugin.events.validator import SPARSE_KINDS
from vllm_kvbm_plugin.hashing import extra_hash, request_keys
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import disk as diskfmt
from vllm_kvbm_plugin.tiers.index import TierIndex
from vllm_kvbm_plugin.tiers.policies import make_policy

logger = get_logger("connector")


_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE_STORED = msgspec.msgpack.Decoder(BlockStored).decode


def _file_info(meta: bytes | None):
    """(token position the entry ends at, [BlockStored]) from a block file's metadata, or None."""
    try:
        info = msgspec.msgpack.decode(meta) if meta else None
        if not info or not info.get("events"):
            return None
        return int(info["end"]), [_DECODE_STORED(e) for e in info["events"]]
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError, KeyError):
        return None


@dataclasses.dataclass
class _Announce:
    events: list  # BlockStored per group, published once the bytes are in place (empty: internal)
    vhash: object = None  # vLLM's event hash of the entry, for BlockRemoved
    announced: bool = False


@dataclasses.dataclass
class _Request:
    request: object
    unit_keys: list  # stable keys of the hash units computed so far
    stored_upto: int = 0  # blocks [0, stored_upto) were offered to the tiers


@dataclasses.dataclass
class _Need:
    """One tier entry a hit needs: where it goes in the request's blocks."""
    key: tuple
    kind: str  # KV or STATE
    index: int  # KV: block index; STATE: the hit's token count
    direct: bool = False  # loaded from its open disk file, not from a CPU slot


@dataclasses.dataclass
class _Direct:
    """A disk entry the workers verify and keep open for a direct load."""
    ready: bool = False  # every worker verified it
    requests: set = dataclasses.field(default_factory=set)  # the requests waiting for it


def _max_direct() -> int:
    """Disk entries held open per worker at once: a quarter of the file descriptor limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 8192 if soft == resource.RLIM_INFINITY else max(16, min(8192, soft // 4))


MAX_DIRECT = _max_direct()


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: KVBMConfig):
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

        self.groups = entry_groups(kv_cache_config)  # raises for group kinds the tiers cannot hold
        self.hybrid = bool(self.groups[STATE])
        kv_groups = kv_cache_config.kv_cache_groups
        self.spec_kind = [get_kv_cache_spec_kind(g.kv_cache_spec).value for g in kv_groups]
        self.cfg = cfg
        self.block_size = kv_groups[0].kv_cache_spec.block_size
        self.hash_unit = kv_cache_config.hash_block_size or self.block_size
        self.units_per_block = self.block_size // self.hash_unit
        self.slot_bytes = slot_bytes(kv_cache_config)
        self.world = vllm_config.parallel_config.world_size
        self.root = key_root(vllm_config, kv_cache_config, self.hash_unit)
        self.cpu = TierIndex(cfg.cpu_bytes_to_use // self.slot_bytes, make_policy(cfg.eviction_policy))
        self.disk: TierIndex | None = None
        self.disk_writes_on = False
        if cfg.disk_path:
            self.disk = TierIndex(cfg.disk_bytes_to_use // self.slot_bytes, make_policy(cfg.eviction_policy))
            self.disk_bases = [rank_dir(cfg.disk_path, self.root, r) for r in range(self.world)]
            self.disk_writes_on = True
        self.requests: dict[str, _Request] = {}
        self.claims: dict[str, tuple[int, int, list[_Need]]] = {}  # req id -> (from, tokens, entries)
        self.state_loads: dict[str, tuple[int, tuple]] = {}  # req id -> (hit tokens, source): see _load_state
        self.prefetching: set = set()  # keys being read from disk into CPU slots
        self.direct: dict = {}  # key -> _Direct: disk entries verified and held open by the workers
        self.meta = KVBMMetadata()
        self.loads_pinned: list = []
        self.parent_pins: dict = {}  # (medium, key) -> parent pinned until the key settles
        self.reports: Counter = Counter()
        self.events: list = []
        self.to_event_hashes = compat.event_hash_converter()
        self.pool = None  # vLLM's BlockPool, bound later (extra keys like vLLM computes them)
        self.kv_cache_manager = None  # bound later (block ids of the requests)
        if self.disk is not None:
            self._load_disk_index()
        logger.info(
            "KVBMConnector: CPU tier %d slots of %d bytes (%.1f MiB), disk tier %s, eviction %s%s",
            self.cpu.capacity, self.slot_bytes, self.cpu.capacity * self.slot_bytes / 2**20,
            f"{self.disk.capacity} slots under {cfg.disk_path}" if self.disk is not None else "off",
            cfg.eviction_policy,
            f", hybrid: state groups {self.groups[STATE]}, hits every {self.hash_unit} tokens"
            if self.hybrid else "",
        )

    # ---- keys and events -------------------------------------------------------------------
    def _state(self, request) -> _Request:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = _Request(request, [])
        return st

    def _unit_keys(self, st: _Request, n_units: int) -> list:
        """Stable keys of the request's first n_units hash units (computed once, extended)."""
        unit, have = self.hash_unit, len(st.unit_keys)
        if n_units > have:
            req = st.request
            tokens = req.all_token_ids[have * unit : n_units * unit]
            extras = None
            if compat.has_extra_keys(req):
                extras = {}
                for u in compat.units_with_extra_keys(req, unit, have, n_units):
                    keys, _ = compat.block_extra_keys(self.pool, req, u * unit, (u + 1) * unit, 0)
                    if keys:
                        extras[u - have] = extra_hash(keys)
            parent = st.unit_keys[-1] if have else self.root
            new = request_keys(tokens, unit, parent, extras)
            st.unit_keys += map(tuple, new.tolist())  # (int, int): hashable tier keys
        return st.unit_keys

    def _block_key(self, st: _Request, i: int):
        """Key of block i: the key of its last unit."""
        return self._unit_keys(st, (i + 1) * self.units_per_block)[(i + 1) * self.units_per_block - 1]

    def _announcement(self, request, start: int, end: int, kind: str, medium: str) -> _Announce:
        """The BlockStored events (one per group of `kind`) of the tokens [start, end)."""
        hashes, unit = request.block_hashes, self.hash_unit
        if len(hashes) < end // unit:
            return _Announce([])
        conv = self.to_event_hashes
        vhash = conv([hashes[end // unit - 1]])[0]
        parent = conv([hashes[start // unit - 1]])[0] if start else None
        extra = None
        if compat.has_extra_keys(request):
            extra = to_event_extra_keys([compat.block_extra_keys(self.pool, request, start, end, 0)[0]])
        events = []
        for g in self.groups[kind]:
            event = compat.block_stored_event(
                self.pool, request, block_hashes=[vhash], parent_block_hash=parent,
                token_ids=request.all_token_ids[start:end], block_size=end - start, group_idx=g,
                extra_keys=extra or [None], medium=medium)
            event.kv_cache_spec_kind = self.spec_kind[g]
            events.append(event)
        return _Announce(events, vhash)

    def _reserve(self, tier: TierIndex, medium: str, key, parent, announce):
        """Reserve `key` in `tier` (announce(medium) gives its events); its parent stays pinned
        until the key is settled, so a BlockRemoved of the parent never precedes the child's
        BlockStored."""
        if parent is not None:
            tier.pin(parent)
        entry, evicted = tier.reserve(key, parent, announce(medium))
        self._gone(evicted, medium)
        if entry is None:
            if parent is not None:
                tier.unpin(parent)
        elif parent is not None:
            self.parent_pins[(medium, key)] = parent
        return entry

    def _settle(self, tier: TierIndex, medium: str, key, ok: bool) -> None:
        """The bytes of `key` landed (ok) or not: announce or drop it, release its parent."""
        parent = self.parent_pins.pop((medium, key), None)
        if parent is not None:
            tier.unpin(parent)
        if ok:
            e = tier.complete(key)
            if e is not None:
                self._announce_stored(e)
        else:
            tier.remove(key)

    def _announce_stored(self, entry) -> None:
        a = entry.meta
        if a is not None and a.events and not a.announced:
            self.events += a.events
            a.announced = True

    def _gone(self, evicted, medium: str) -> None:
        """Entries that left a tier: announce the removals (per group), delete disk files."""
        by_group: dict[int, list] = {}
        for _, e in evicted:
            if e is not None and e.meta is not None and e.meta.announced:
                for ev in e.meta.events:
                    by_group.setdefault(ev.group_idx, []).append(e.meta.vhash)
        for g, hashes in by_group.items():
            self.events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=g))
        if medium == MEDIUM_DISK:
            for key, _ in evicted:
                self._unlink(key)

    def _load_disk_index(self) -> None:
        """Index the block files of earlier runs and announce them (parents first) from the
        BlockStored events each file carries in its metadata."""
        found = diskfmt.scan(self.disk_bases[0])
        described, unreadable = [], 0
        for key, _size in found:
            meta = diskfmt.read_meta(diskfmt.block_path(self.disk_bases[0], key))
            if meta is None:  # unreadable, or another format version: it could never be a hit
                self._unlink(key)
                unreadable += 1
                continue
            e, evicted = self.disk.reserve(key)
            self._gone(evicted, MEDIUM_DISK)  # more files than disk_bytes_to_use allows
            if e is None:
                continue
            self.disk.complete(key)
            info = _file_info(meta)
            if info is not None:
                e.meta = _Announce(info[1], info[1][0].block_hashes[0])
                described.append((info[0], e))
        held = set()
        for _, e in sorted(described, key=lambda d: d[0]):
            if all(ev.kv_cache_spec_kind in SPARSE_KINDS or ev.parent_block_hash is None
                   or (ev.group_idx, ev.parent_block_hash) in held for ev in e.meta.events):
                self._announce_stored(e)
                held.update((ev.group_idx, e.meta.vhash) for ev in e.meta.events)
        if found:
            announced = sum(e.meta.announced for _, e in described)
            logger.info("KVBMConnector: disk tier holds %d entries from earlier runs (%d announced, %d "
                        "unreadable files removed)", len(self.disk), announced, unreadable)

    def _unlink(self, key) -> None:
        for base in self.disk_bases:
            try:
                os.unlink(diskfmt.block_path(base, key))
            except OSError:
                pass

    # ---- vLLM hooks ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        start = num_computed_tokens // self.block_size
        limit = request.num_tokens - 1  # vLLM must compute at least one token
        st = self._state(request)
        plan = self._plan(st, start, limit, self._held)
        if plan is None:
            self._release_claim(request.request_id)
            return 0, False
        if any(n.key in self.prefetching or (n.key in self.direct and not self.direct[n.key].ready)
               for n in plan[1]):
            return None, False  # their verification is still running
        on_disk_only = [n for n in plan[1] if not self._loadable(n.key)]
        if on_disk_only:
            in_cpu = [n.key for n in plan[1] if self.cpu.ready(n.key)]
            for k in in_cpu:  # a prefetch may evict CPU entries, but none this hit needs
                self.cpu.pin(k)
            rest = self._prefetch(st, on_disk_only)
            issued = self._open_direct(request.request_id, rest) + len(on_disk_only) - len(rest)
            for k in in_cpu:
                self.cpu.unpin(k)
            if issued:
                return None, False  # come back once the disk entries are verified
            plan = self._plan(st, start, limit, self._loadable)  # what can be loaded now
        self._release_claim(request.request_id)
        if plan is None:
            return 0, False
        tokens, needs = plan
        for n in needs:  # nothing may evict a claimed entry or close its file before its load has run
            if self.cpu.ready(n.key):
                self.cpu.pin(n.key)
            else:
                n.direct = True
                self.direct[n.key].requests.add(request.request_id)
        self.claims[request.request_id] = (num_computed_tokens, tokens - num_computed_tokens, needs)
        return tokens - num_computed_tokens, False

    def _loadable(self, key) -> bool:
        """In a CPU slot, or verified and held open for a direct load."""
        return bool(self.cpu.ready(key) or (key in self.direct and self.direct[key].ready))

    def _open_direct(self, req_id: str, needs: list[_Need]) -> int:
        """Ask the workers to verify and hold open the disk entries of `needs` (as many as
        MAX_DIRECT allows); returns how many were newly asked for."""
        issued = 0
        for n in needs:
            d = self.direct.get(n.key)
            if d is None:
                if len(self.direct) >= MAX_DIRECT:
                    break
                d = self.direct[n.key] = _Direct()
                self.disk.pin(n.key)
                self.meta.opens.append(n.key)
                issued += 1
            d.requests.add(req_id)
        return issued

    def _close_direct(self, key) -> None:
        if self.direct.pop(key, None) is not None:
            self.disk.unpin(key)
            self.meta.closes.append(key)

    def _drop_direct(self, req_id: str) -> None:
        """`req_id` no longer waits for its direct entries (loaded, or not needed any more)."""
        for d in self.direct.values():
            d.requests.discard(req_id)

    def _held(self, key) -> bool:
        return bool(self.cpu.ready(key) or (self.disk is not None and self.disk.ready(key)))

    def _plan(self, st: _Request, start: int, limit: int, held) -> tuple[int, list[_Need]] | None:
        """The longest hit past block `start` (tokens, entries it needs) whose entries all pass
        `held`, or None. A hit never covers token `limit`."""
        B, r = self.block_size, self.units_per_block
        full = start  # blocks [start, full) are held
        while (full + 1) * B <= limit and held(self._block_key(st, full)):
            full += 1
        if not self.hybrid:
            return (full * B, [_Need(self._block_key(st, i), KV, i) for i in range(start, full)]) if full > start else None
        unit = self.hash_unit
        keys = self._unit_keys(st, limit // unit)
        for u in range(limit // unit, start * r, -1):  # the hit ends after unit u-1: X = u * unit
            x, nb = u * unit, u // r
            if nb > full or not held(state_key(keys[u - 1])):
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
        for n in self.claims.pop(req_id, (0, 0, []))[2]:
            if not n.direct:
                self.cpu.unpin(n.key)

    def _prefetch(self, st: _Request, needs: list[_Need]) -> list[_Need]:
        """Read disk entries into CPU slots, in order, while the CPU tier has room and holds the
        block each one extends (so the CPU medium stays prefix-closed, as stores keep it: a router
        never sees a CPU block without its parent); returns the needs left for direct loads."""
        B = self.block_size
        for i, n in enumerate(needs):
            before = n.index - 1 if n.kind == KV else n.index // B - 1  # the block this entry extends
            parent = self._block_key(st, before) if before >= 0 else None
            if parent is not None and parent not in self.cpu:
                return needs[i:]
            entry = self._reserve(self.cpu, MEDIUM_CPU, n.key, parent, self._disk_announce(n.key))
            if entry is None:
                return needs[i:]
            self.disk.pin(n.key)
            self.prefetching.add(n.key)
            self.meta.prefetches.append((n.key, entry.slot))
        return []

    def _disk_announce(self, key):
        """The CPU events of an entry coming back from disk: its DISK events, medium changed."""
        meta = self.disk.entries[key].meta

        def announce(medium):
            if meta is None or not meta.events:
                return _Announce([])
            return _Announce([msgspec.structs.replace(ev, medium=medium) for ev in meta.events], meta.vhash)
        return announce

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        claim = self.claims.pop(request.request_id, None)
        if claim is None:
            return
        computed, claimed, needs = claim
        if self.hybrid and 0 < num_external_tokens != claimed:
            # the state at the claimed end cannot be cut shorter; no vLLM path does this today
            logger.error("KVBMConnector: vLLM took %d of the %d tokens claimed for request %s; "
                         "nothing is loaded", num_external_tokens, claimed, request.request_id)
            num_external_tokens = 0
        end = computed + max(num_external_tokens, 0)
        block_ids = blocks.get_block_ids()
        for n in needs:
            if n.kind == STATE:
                wanted = num_external_tokens > 0
            else:  # a whole block, or the partial block a hybrid hit ends inside
                wanted = (n.index + 1) * self.block_size <= end or (self.hybrid and num_external_tokens > 0)
            if not wanted:
                if not n.direct:
                    self.cpu.unpin(n.key)
                continue
            if n.direct:
                source = ("disk", n.key)  # held open until the metadata is built
            else:
                self.cpu.touch(n.key)
                self.loads_pinned.append(n.key)  # unpinned once the metadata is built
                source = ("cpu", self.cpu.entries[n.key].slot)
            if n.kind == STATE:
                self.state_loads[request.request_id] = (n.index, source)
            else:
                self._add_load(KV, tuple(block_ids[g][n.index] for g in self.groups[KV]), source)
        self._drop_direct(request.request_id)

    def _add_load(self, kind: str, ids: tuple, source: tuple) -> None:
        if source[0] == "cpu":
            self.meta.loads.append((kind, ids, source[1]))
        else:
            self.meta.disk_loads.append((kind, ids, source[1]))

    def build_connector_meta(self, scheduler_output) -> KVBMMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            scheduled = scheduler_output.num_scheduled_tokens[new.req_id]
            self._load_state(new.req_id, scheduled)
            self._store(new.req_id, new.num_computed_tokens + scheduled, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._load_state(req_id, scheduler_output.num_scheduled_tokens[req_id])  # resumed requests
            self._store(req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id],
                        scheduler_output)
        for k in self.loads_pinned:
            self.cpu.unpin(k)
        self.loads_pinned = []
        # files no request waits for any more are closed once per step, after every load of the step
        # (the workers read before they close), so a file is never closed and opened in one step
        for k in [k for k, d in self.direct.items() if d.ready and not d.requests]:
            self._close_direct(k)
        for req_id in list(self.claims):  # claimed, but vLLM could not allocate: no load
            self._release_claim(req_id)
        self.state_loads.clear()
        meta, self.meta = self.meta, KVBMMetadata()
        return meta

    def _load_state(self, req_id: str, scheduled: int) -> None:
        """Load a hit's recurrent state into the block vLLM reads it from, (X-1)//B, and into the
        block this step's state goes to: vLLM copies the first into the second before the
        forward but after nothing of ours ran (preprocess_mamba precedes start_load_kv)."""
        pending = self.state_loads.pop(req_id, None)
        if pending is None:
            return
        x, source = pending
        B = self.block_size
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        null = self.pool.null_block.block_id
        for index in sorted({(x - 1) // B, (x + scheduled + B - 1) // B - 1}):
            ids = tuple(block_ids[g][index] for g in self.groups[STATE])
            if null in ids:
                logger.error("KVBMConnector: request %s has no state block at index %d", req_id, index)
                continue
            self._add_load(STATE, ids, source)

    def _store(self, req_id: str, computed_after_step: int, scheduler_output) -> None:
        st = self.requests.get(req_id)
        if st is None:
            return
        req = st.request
        B = self.block_size
        prompt_only = self.cfg.offload_prompt_only
        n_full = computed_after_step // B
        if prompt_only:
            n_full = min(n_full, req.num_prompt_tokens // B)
        block_ids = None
        i = st.stored_upto
        while i < n_full:
            k, parent = self._block_key(st, i), self._block_key(st, i - 1) if i else None
            if parent is not None and parent not in self.cpu:
                break  # a tier holds whole prefixes: no block without its parent
            entry = self.cpu.entries.get(k)
            announce = self._announcer(req, i * B, (i + 1) * B, KV)
            if entry is None:
                entry = self._reserve(self.cpu, MEDIUM_CPU, k, parent, announce)
                if entry is None:
                    break
                if block_ids is None:
                    block_ids = self.kv_cache_manager.get_block_ids(req_id)
                self.meta.stores.append((k, KV, tuple(block_ids[g][i] for g in self.groups[KV]), entry.slot))
            else:
                self.cpu.touch(k)
            self._write_through(k, parent, entry, (i + 1) * B, announce)
            i += 1
        st.stored_upto = max(st.stored_upto, i)
        x = computed_after_step
        if (self.hybrid and x % self.hash_unit == 0 and x >= self.hash_unit
                and (x % B == 0 or x <= req.num_prompt_tokens) and not (prompt_only and x > req.num_prompt_tokens)
                and not scheduler_output.scheduled_spec_decode_tokens.get(req_id)):
            self._store_state(st, x)

    def _store_state(self, st: _Request, x: int) -> None:
        """The recurrent state at x (and the KV block x ends inside), right after the step that
        ended at x wrote it."""
        B, req = self.block_size, st.request
        nb = x // B
        parent = self._block_key(st, nb - 1) if nb else None
        if parent is not None and parent not in self.cpu:
            return  # useless without every block before it
        block_ids = self.kv_cache_manager.get_block_ids(req.request_id)
        unit_key = self._unit_keys(st, x // self.hash_unit)[x // self.hash_unit - 1]
        # the state's events mirror vLLM's: a whole block at block ends, else the last hash unit
        first = x - (self.hash_unit if x % B else B)
        entries = [(state_key(unit_key), STATE, (x - 1) // B, self._announcer(req, first, x, STATE))]
        if x % B:
            entries.append((partial_key(unit_key), KV, nb, lambda medium: _Announce([])))
        null = self.pool.null_block.block_id
        for k, kind, index, announce in entries:
            ids = tuple(block_ids[g][index] for g in self.groups[kind])
            if null in ids:
                return
            entry = self.cpu.entries.get(k)
            if entry is None:
                entry = self._reserve(self.cpu, MEDIUM_CPU, k, parent, announce)
                if entry is None:
                    return
                self.meta.stores.append((k, kind, ids, entry.slot))
            else:
                self.cpu.touch(k)
            self._write_through(k, parent, entry, x, announce)

    def _announcer(self, request, start: int, end: int, kind: str):
        return lambda medium: self._announcement(request, start, end, kind, medium)

    def _write_through(self, k, parent, cpu_entry, end: int, announce) -> None:
        if not self.disk_writes_on or k in self.disk or (parent is not None and parent not in self.disk):
            return
        if self._reserve(self.disk, MEDIUM_DISK, k, parent, announce) is None:
            return
        self.cpu.pin(k)  # the slot is the source of the write
        # where the entry ends and its DISK events: announced again after a restart
        events = self.disk.entries[k].meta.events
        blob = _ENCODE({"end": end, "events": [_ENCODE(e) for e in events]})
        self.meta.disk_writes.append((k, cpu_entry.slot, blob))

    def update_connector_output(self, output) -> None:
        wm: KVBMWorkerMetadata | None = getattr(output, "kv_connector_worker_meta", None)
        if not wm:
            return
        for k in self._done("stored", wm.stored):
            self._settle(self.cpu, MEDIUM_CPU, k, True)
        for k in self._done("prefetched", wm.prefetched):
            self.prefetching.discard(k)
            self.disk.unpin(k)
            self._settle(self.cpu, MEDIUM_CPU, k, True)
        for k in dict.fromkeys(wm.prefetch_failed):
            self.prefetching.discard(k)
            self._settle(self.cpu, MEDIUM_CPU, k, False)
            self._lost_on_disk(k)
        for k in self._done("opened", wm.opened):
            if k in self.direct:
                self.direct[k].ready = True
        for k in dict.fromkeys(wm.open_failed):
            self.reports.pop(("opened", k), None)
            self._close_direct(k)  # on the workers that did open it
            self._lost_on_disk(k)
        for k in self._done("written", wm.disk_written):
            self.cpu.unpin(k)  # the write's source slot
            self._settle(self.disk, MEDIUM_DISK, k, True)
        failed = list(dict.fromkeys(wm.disk_failed))
        for k in failed:
            self.cpu.unpin(k)
            self._settle(self.disk, MEDIUM_DISK, k, False)
        if failed and self.disk_writes_on:
            self.disk_writes_on = False
            logger.warning("KVBMConnector: disk writes failed (%d blocks); the disk tier stops "
                           "storing and keeps serving what it holds", len(failed))

    def _lost_on_disk(self, key) -> None:
        logger.warning("KVBMConnector: disk block %s is corrupt or missing; dropped (a miss)", diskfmt.key_hex(key))
        self._gone([(key, self.disk.remove(key))], MEDIUM_DISK)

    def _done(self, kind: str, keys: list) -> list:
        """Keys every worker has reported for `kind` (one report per worker)."""
        out = []
        for k in keys:
            self.reports[(kind, k)] += 1
            if self.reports[(kind, k)] >= self.world:
                del self.reports[(kind, k)]
                out.append(k)
        return out

    def request_finished(self, request) -> None:
        self.requests.pop(request.request_id, None)
        self._release_claim(request.request_id)
        self._drop_direct(request.request_id)

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events
