"""Which hash units each physical block of a BlockPool holds, and the KV events that follow
(`UnitTracker`): the bookkeeping of per-unit KV events for full-attention groups whose block vLLM
inflated (hybrid models). What is announced when, and why, is told in patches/sub_block_events.py,
which builds one tracker per BlockPool (EngineCore process, scheduler thread) and calls it from its
wrappers of vLLM's caching, eviction and reset methods.

Pure: no vLLM import. The few pieces of vLLM the events are built with (its event classes, extra
keys, hash conversion) are handed in once per process by that patch (`UnitTracker.vllm`, a
`VllmEventApi`), so the bookkeeping reads, and is tested, as the data structure it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

# vLLM's objects, by the names they have there: this module imports no vLLM (see the module docstring)
BlockPool = Any
Request = Any
KVCacheBlock = Any


class VllmEventApi(NamedTuple):
    """What a UnitTracker needs of vLLM to build its events. Bound once per process by
    patches/sub_block_events.py `apply` (as `UnitTracker.vllm`); read by each tracker when it is
    built."""

    block_stored: type  # vllm.distributed.kv_events.BlockStored
    block_removed: type  # vllm.distributed.kv_events.BlockRemoved
    to_event_extra_keys: Callable  # vllm.v1.core.kv_cache_utils.to_event_extra_keys
    block_extra_keys: Callable  # compat.block_extra_keys(pool, request, start, end, mm_idx)
    has_extra_keys: Callable  # compat.has_extra_keys(request)
    event_hash_converter: Callable  # compat.event_hash_converter: () -> list-at-a-time converter


class UnitTracker:
    """Which hash units (and inflated blocks) each physical block holds, for one BlockPool.

    Keys are announced once while any physical block holds them, because vLLM may cache the same
    hash in two blocks (a hybrid request recomputing a prefix whose Mamba state is gone, or two
    prompts that diverge inside a block). Hashes chain over the token prefix, so two blocks share
    unit j only at the same position and only if they share every earlier unit: blocks can share
    units only if they share their first one, and then they share a prefix of their units.

    So only a block's first unit is indexed (`heads`). A block alone there (the usual case) holds
    all its units alone: caching or releasing it costs a few Python operations per block and none
    per unit. Blocks sharing a first unit are kept as a list of holders; the units others hold
    are the longest prefix any of them shares with the block (`_shared`, usually one comparison).

    Owned by its BlockPool (`pool._kvbm_units`), in the EngineCore process; built by
    patches/sub_block_events.py when a KVCacheManager has groups that need per-unit events, and
    called only from that module's wrappers of the pool's methods, on the scheduler's thread. Its
    events go into the pool's `kv_event_queue`, where vLLM takes them with its own.
    """

    # Set once a tracker exists in this process (and event hashes are ints): each request then
    # keeps its hashes in event form too (`_kvbm_event_hashes`), converted as vLLM computes them,
    # when the new digests are still in the CPU cache and, in an engine, in its input thread
    # rather than its step.
    convert_on_hashing = None
    # vLLM's side (`VllmEventApi`), bound once per process by patches/sub_block_events.py before
    # any tracker is built: this module imports no vLLM
    vllm: VllmEventApi | None = None

    def __init__(self, pool: BlockPool, units_per_block: dict[int, int], coarse: bool) -> None:
        vllm = self.vllm
        if vllm is None:
            raise RuntimeError("UnitTracker.vllm is unset: patches/sub_block_events.py binds vLLM's event API")
        self._stored, self._removed = vllm.block_stored, vllm.block_removed
        self._has_extra_keys, self._block_extra_keys = vllm.has_extra_keys, vllm.block_extra_keys
        self._to_event_extra_keys = vllm.to_event_extra_keys
        self.pool = pool
        self.medium = pool.medium
        self.unit = pool.hash_block_size
        self.units_per_block = units_per_block  # group id -> P // B
        self.coarse = coarse
        # Hashes are kept in event form (converted once per unit, when it is cached).
        self.by_block: dict[int, tuple[int, list]] = {}  # block id -> (group, [unit hashes])
        # group -> first unit hash -> its only holder's by_block entry, or, when blocks share it,
        # the list of their entries
        self.heads: dict[int, dict] = {g: {} for g in units_per_block}
        self.to_event_hashes = vllm.event_hash_converter()
        # (request, first token, end token, token_ids) of the last BlockStored vLLM built for an
        # untracked group (e.g. Mamba, cached just before): the same token list serves our events
        self.recent_tokens: tuple | None = None
        # (request, has extra keys, LoRA id, LoRA name, session) of the request cached last
        self.fields: tuple = (None,)
        # Removed hashes per group, coarse and unit kept apart, sent as one BlockRemoved each
        # before our next BlockStored and when vLLM takes the step's events (`flush_removed`).
        self.removed_coarse: dict[int, list] = {}
        self.removed_units: dict[int, list] = {}

    def cache(self, request: Request, group: int, blocks: list[KVCacheBlock], start: int, end: int,
              mask: Sequence[bool] | None = None) -> None:
        """blocks[start:end] of the request now hold all their units.

        Hashes are converted for the whole range at once, but for the units the first block already
        holds (vLLM cached its prompt tail, and decoding then filled it); per block only its slice
        is kept.
        """
        r, by_block = self.units_per_block[group], self.by_block
        first = by_block.get(blocks[start].block_id)
        known = first[1] if first is not None else ()
        conv = self.event_hashes(request, start * r + len(known), end * r)
        if known:
            conv = known + conv
        heads, coarse = self.heads[group], self.coarse
        unit_runs: list[list] = []  # [first unit, end unit, index in conv] of fresh units
        block_runs: list[list] = []  # [first block, end block, index in conv] of fresh full blocks
        for bi in range(start, end):
            block = blocks[bi]
            if block.is_null or (mask is not None and not mask[bi - start]):
                continue
            a = (bi - start) * r  # the block's units in conv
            entry = by_block.get(block.block_id)
            if entry is None:  # usually the first holder of its first unit: no call (see `_join`)
                entry = by_block[block.block_id] = (group, conv[a : a + r])
                holders = heads.setdefault(conv[a], entry)
                k = 0 if holders is entry else self._join(heads, holders, entry)
            else:
                had = len(entry[1])
                if had >= r:
                    continue
                k = self._extend(heads, entry, conv[a + had : a + r])
            if k == r:  # other blocks hold all its units
                continue
            # runs of consecutive fresh keys (the last run grows while contiguous)
            u = bi * r
            if unit_runs and unit_runs[-1][1] == u + k:
                unit_runs[-1][1] = u + r
            else:
                unit_runs.append([u + k, u + r, a + k])
            if coarse:
                if block_runs and block_runs[-1][1] == bi:
                    block_runs[-1][1] = bi + 1
                else:
                    block_runs.append([bi, bi + 1, a + r - 1])
        tokens: dict = {}  # token slices shared by coarse and unit events over the same range
        recent = self.recent_tokens
        if recent is not None and recent[0] is request:
            tokens[(recent[1], recent[2])] = recent[3]
            self.recent_tokens = None
        if not (unit_runs or block_runs):
            return
        # The parent of a run starting at this range's first unit is the unit before the range,
        # converted once for the coarse and the unit events; the previous block usually holds it.
        parent = None
        if start and ((unit_runs and unit_runs[0][2] == 0) or (block_runs and block_runs[0][2] < r)):
            prev = by_block.get(blocks[start - 1].block_id)
            if prev is not None and len(prev[1]) == r:
                parent = prev[1][-1]
            else:
                parent = self.event_hashes(request, start * r - 1, start * r)[0]
        self._announce(request, group, r, block_runs, unit_runs, conv, tokens, parent)

    def cache_partial(self, request: Request, group: int, block: KVCacheBlock, index: int, n: int) -> None:
        """Block `index` of the request now holds its first n units (vLLM's partial key at the
        prompt's last hash boundary, 0 < n < units per block). Only units the block did not hold
        yet are converted and announced: vLLM registers that boundary again at every later step
        of the request, which then costs a lookup and a comparison."""
        if n <= 0:  # vLLM registers no partial key at a block boundary; an empty entry has no head
            return
        r = self.units_per_block[group]
        first = index * r
        entry = self.by_block.get(block.block_id)
        heads = self.heads[group]
        before = None  # the unit before the block, when the event may need it as parent
        if entry is None:
            if first:  # fetched with the block's units (one call, not two)
                held = self.event_hashes(request, first - 1, first + n)
                before = held[0]
                del held[0]
            else:
                held = self.event_hashes(request, 0, n)
            entry = self.by_block[block.block_id] = (group, held)
            holders = heads.setdefault(held[0], entry)
            k = 0 if holders is entry else self._join(heads, holders, entry)
        else:
            held = entry[1]
            had = len(held)
            if had >= n:  # vLLM registers the prompt's last boundary again at every later step
                return
            k = self._extend(heads, entry, self.event_hashes(request, first + had, first + n))
        if k >= n:
            return
        parent = held[k - 1] if k else before
        self._announce(request, group, r, (), [[first + k, first + n, 0]], held[k:], {}, parent)

    def cache_hit(self, request: Request, group: int, n: int) -> None:
        """The request's first n units are a prefix-cache hit, to be announced again (vLLM's
        `kv_cache_report_mode` "full", for gateways that learn about hits): one unit event from
        the first unit, and coarse keys for the whole blocks among them."""
        r = self.units_per_block[group]
        block_runs = [[0, n // r, r - 1]] if self.coarse and n >= r else ()
        conv = self.event_hashes(request, 0, n)
        self._announce(request, group, r, block_runs, [[0, n, 0]], conv, {}, None)

    def event_hashes(self, request: Request, lo: int, hi: int) -> list[Any]:
        """The request's unit hashes [lo, hi) in event form: a slice of those converted as vLLM
        computed them, or converted now (a request hashed before the tracker existed, or whose
        hashes vLLM truncated since)."""
        converted = request._kvbm_event_hashes
        if converted is not None and len(converted) == len(request.block_hashes):
            return converted[lo:hi]
        return self.to_event_hashes(request.block_hashes[lo:hi])

    @staticmethod
    def _join(heads: dict[Any, Any], holders: Any, entry: tuple[Any, ...]) -> int:
        """Add a block's new entry to the other holders of its first unit; returns how many of
        its units they hold. The callers record a block alone at its first unit (the usual case)
        themselves, saving a call per cached block."""
        held = entry[1]
        if type(holders) is tuple:  # a second holder
            holders = heads[held[0]] = [holders]
        k = _shared(held, holders)
        holders.append(entry)
        return k

    @staticmethod
    def _extend(heads: dict, entry: tuple, units: list) -> int:
        """Add units to a block's entry; returns how many of its units other blocks hold (at
        least those it held before)."""
        held = entry[1]
        had = len(held)
        held += units
        holders = heads[held[0]]
        return had if holders is entry else max(had, _shared(held, holders, entry))

    def release(self, block_id: int) -> None:
        entry = self.by_block.pop(block_id, None)
        if entry is None:
            return
        group, held = entry
        heads = self.heads[group]
        holders = heads[held[0]]
        if holders is entry:
            del heads[held[0]]
            k = 0
        else:
            for i, other in enumerate(holders):
                if other is entry:
                    del holders[i]
                    break
            k = _shared(held, holders)
            if len(holders) == 1:
                heads[held[0]] = holders[0]
        r = self.units_per_block[group]
        if self.coarse and len(held) == r and k < r:
            coarse = self.removed_coarse.get(group)
            if coarse is None:
                self.removed_coarse[group] = [held[-1]]
            else:
                coarse.append(held[-1])
        if k < len(held):
            units = self.removed_units.get(group)
            if units is None:  # the entry is gone: its list (no event holds it) can be the batch
                self.removed_units[group] = held[k:] if k else held
            else:
                units += held[k:] if k else held

    def move(self, src_id: int, dst_id: int) -> None:
        entry = self.by_block.pop(src_id, None)
        if entry is not None:
            self.by_block[dst_id] = entry

    def clear(self) -> None:
        self.removed_coarse.clear()
        self.removed_units.clear()
        self.by_block.clear()
        for heads in self.heads.values():
            heads.clear()

    def flush_removed(self) -> None:
        """One BlockRemoved per group for its coarse keys, one for its units, in removal order
        (coarse first, as a block's coarse key ends its last unit)."""
        queue, medium, removed = self.pool.kv_event_queue, self.medium, self._removed
        for pending in (self.removed_coarse, self.removed_units):
            for group, hashes in pending.items():
                queue.append(removed(block_hashes=hashes, medium=medium, group_idx=group))
            pending.clear()

    def _announce(self, request: Request, group: int, r: int, block_runs: Sequence[Any], unit_runs: Sequence[Any],
                  conv: list[Any], tokens: dict[Any, Any], parent_before: Any) -> None:
        """One BlockStored per run of consecutive fresh keys, chained to the key before: first the
        runs of whole blocks (coarse keys of r units), then the runs of units. Pending removals
        are sent before.

        Key i of n units covers tokens [i*n*B, (i+1)*n*B) with B = hash_block_size; its hash (event
        form) is the chained unit hash at its last unit, which is what vLLM announces for a block
        of n*B tokens. A run (first key, end key, lo) has the hashes conv[lo :: n], one per key; a
        run starting at conv's first key has parent `parent_before`. Events are filled like
        `compat.block_stored_event` fills them, with the request's fields looked up once per
        request (it is cached in several calls during a chunked prefill).
        """
        if request is not self.fields[0]:
            lora = request.lora_request
            self.fields = (request, self._has_extra_keys(request), lora.adapter_id if lora else None,
                           lora.name if lora else None, request.session_id)
        if self.removed_units or self.removed_coarse:
            self.flush_removed()
        queue, medium, stored = self.pool.kv_event_queue, self.medium, self._stored
        _, with_extra, lora_id, lora_name, session_id = self.fields
        for units, runs in ((r, block_runs), (1, unit_runs)):
            size = units * self.unit
            for first, end, lo in runs:
                if with_extra:
                    extra, mm_idx = [], 0
                    for k in range(first, end):
                        e, mm_idx = self._block_extra_keys(self.pool, request, k * size, (k + 1) * size,
                                                           mm_idx)
                        extra.append(e)
                    extra = self._to_event_extra_keys(extra)
                else:
                    extra = [None] * (end - first)
                if units == 1:
                    key_hashes = conv if lo == 0 and end - first == len(conv) else conv[lo : lo + end - first]
                else:
                    key_hashes = conv[lo : lo + (end - first - 1) * units + 1 : units]
                parent = conv[lo - units] if lo >= units else parent_before
                span = (first * size, end * size)
                token_ids = tokens.get(span)
                if token_ids is None:
                    token_ids = tokens[span] = request.all_token_ids[span[0] : span[1]]
                queue.append(
                    stored(
                        block_hashes=key_hashes,
                        parent_block_hash=parent,
                        token_ids=token_ids,
                        block_size=size,
                        lora_id=lora_id,
                        medium=medium,
                        lora_name=lora_name,
                        extra_keys=extra,
                        group_idx=group,
                        session_id=session_id,
                    )
                )


def _shared(units: list[Any], holders: list[Any], skip: object = None) -> int:
    """How many of `units` (a block's, from its first) other holders hold: the longest prefix
    any of them shares with it. Hashes chain, so two blocks agree at unit j exactly when they
    agree on every unit before it: a holder that differs at the best length so far is passed
    over with one comparison, one that agrees at its last shared unit with two."""
    k, size = 0, len(units)
    for entry in holders:
        other = entry[1]
        n = len(other)
        if n > size:
            n = size
        if n <= k or units[k] != other[k] or entry is skip:
            continue
        if units[n - 1] == other[n - 1]:
            k = n
            if k == size:
                break
            continue
        lo, hi = k + 1, n - 1  # units[lo - 1] agrees, units[hi] differs: find the first difference
        while lo < hi:
            mid = (lo + hi) // 2
            if units[mid] == other[mid]:
                lo = mid + 1
            else:
                hi = mid
        k = lo
    return k
