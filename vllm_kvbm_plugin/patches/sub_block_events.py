"""KV events per hash unit for full-attention groups whose block vLLM inflated (hybrid models).

vLLM announces a full-attention group only per (inflated) block, plus one "partial tail" key at the
last prompt hash boundary whose parent was never announced (vllm/v1/core/block_pool.py,
`cache_full_blocks` and `cache_partial_block`, 0.32 and 0.33). When the group's block P is larger
than `hash_block_size` B we announce every B-token unit that vLLM caches instead:

- a unit is cached when its block gets a full key (all P/B units) or a partial-tail key (the units
  up to that boundary); it is announced once while any physical block holds it, chained to the
  previous unit;
- when vLLM evicts or reuses the block (`_maybe_evict_cached_block`) its units are released and
  the last holder's release becomes a BlockRemoved; `reset_prefix_cache` forgets everything (vLLM
  already emits AllBlocksCleared); `move_block_hashes` moves them with vLLM's keys;
- for these groups vLLM's own Stored/Removed events are replaced (the pool's emission is switched
  off around vLLM's caching calls): the partial-tail ones are dropped (our units cover them) and
  the coarse P-sized ones are re-emitted by the same announce-once bookkeeping, so a recomputed
  block is not announced twice. KVBM_COARSE_EVENTS=0 drops the coarse ones entirely.

Mamba / linear-attention groups are left exactly as vLLM emits them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque

from vllm.distributed.kv_events import BlockRemoved
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_group_id, to_event_extra_keys

from vllm_kvbm_plugin import compat, config
from vllm_kvbm_plugin.patches import logger, wrap_method

NAME = "sub_block_events"
_FULL_ATTENTION_KINDS = ("full_attention", "mla_attention")


class UnitTracker:
    """Which hash units (and inflated blocks) each physical block holds, for one BlockPool.

    Keys are announced once while any physical block holds them, because vLLM may cache the same
    hash in two blocks (a hybrid request recomputing a prefix whose Mamba state is gone). Hashes
    chain over the token prefix, so two blocks share unit j only at the same position and only if
    they share every earlier unit: along a block's units, "held elsewhere" is a prefix and the
    holder counts never increase. Finding the fresh (or last-held) suffix is then a binary search,
    and the bulk dict updates run in C; this keeps the scheduler's step time close to vanilla.
    """

    def __init__(self, pool: BlockPool, units_per_block: dict[int, int], coarse: bool):
        self.pool = pool
        self.unit = pool.hash_block_size
        self.units_per_block = units_per_block  # group id -> P // B
        self.coarse = coarse
        # Hashes are kept in event form (converted once per unit, when it is cached).
        self.by_block: dict[int, tuple[int, list]] = {}  # block id -> (group, [unit hashes])
        self.counts: dict[tuple[int, int], dict] = {}  # (group, tokens per key) -> hash -> holders
        self.to_event_hashes = compat.event_hash_converter()

    def cache(self, request, group: int, blocks, start: int, end: int, n_last: int | None = None,
              mask=None) -> None:
        """blocks[start:end] of the request now hold all their units (the last one only n_last).

        Hashes are converted for the whole range at once; per block only its slice is kept.
        """
        r = self.units_per_block[group]
        fine, coarse = self._counts(group, self.unit), self._counts(group, r * self.unit)
        last_units = r if n_last is None else n_last
        conv = self.to_event_hashes(request.block_hashes[start * r : (end - 1) * r + last_units])
        unit_runs: list[list] = []  # [first unit, end unit, event hashes] of fresh units
        block_runs: list[list] = []  # the same for fresh coarse blocks
        for bi in range(start, end):
            block = blocks[bi]
            if block.is_null or (mask is not None and not mask[bi - start]):
                continue
            a = (bi - start) * r
            b = min(a + r, len(conv))
            entry = self.by_block.get(block.block_id)
            if entry is None:
                held, had = conv[a:b], 0
                self.by_block[block.block_id] = (group, held)
            else:
                held = entry[1]
                had = len(held)
                if had >= b - a:
                    continue
                held += conv[a + had : b]
            new = held[had:]
            # units held by another block form a prefix of this block's units; usually none
            k = 0 if new[0] not in fine else bisect_left(new, True, key=lambda h: h not in fine)
            for h in new[:k]:
                fine[h] += 1
            if k < len(new):
                fresh = new[k:] if k else new
                fine.update(dict.fromkeys(fresh, 1))
                _extend_runs(unit_runs, bi * r + had + k, bi * r + b - a, fresh)
            if self.coarse and b - a == r:
                n = coarse.get(held[-1], 0)
                coarse[held[-1]] = n + 1
                if not n:
                    _extend_runs(block_runs, bi, bi + 1, held[-1:])
        tokens: dict = {}  # token slices shared by coarse and unit events over the same range
        self._announce(request, group, r, block_runs, tokens)
        self._announce(request, group, 1, unit_runs, tokens)

    def release(self, block_id: int) -> None:
        entry = self.by_block.pop(block_id, None)
        if entry is None:
            return
        group, held = entry
        r = self.units_per_block[group]
        if self.coarse and len(held) == r:
            self._removed(group, _decrement(self.counts[(group, r * self.unit)], held[-1:]))
        self._removed(group, _decrement(self.counts[(group, self.unit)], held))

    def move(self, src_id: int, dst_id: int) -> None:
        entry = self.by_block.pop(src_id, None)
        if entry is not None:
            self.by_block[dst_id] = entry

    def clear(self) -> None:
        self.by_block.clear()
        self.counts.clear()

    def _counts(self, group: int, tokens: int) -> dict:
        c = self.counts.get((group, tokens))
        if c is None:
            c = self.counts[(group, tokens)] = {}
        return c

    def _removed(self, group: int, hashes: list) -> None:
        if hashes:
            self.pool.kv_event_queue.append(
                BlockRemoved(block_hashes=hashes, medium=self.pool.medium, group_idx=group)
            )

    def _announce(self, request, group: int, units_per_key: int, runs: list, tokens: dict) -> None:
        """One BlockStored per run of consecutive fresh keys, chained to the key before.

        Key i covers tokens [i*n, (i+1)*n) with n = units_per_key * hash_block_size; its hash
        (event form, in the run) is the chained unit hash at its last unit, which is what vLLM
        announces for a block of n tokens.
        """
        n = units_per_key * self.unit
        with_extra = runs and compat.has_extra_keys(request)
        for first, end, key_hashes in runs:
            if with_extra:
                extra, mm_idx = [], 0
                for k in range(first, end):
                    e, mm_idx = compat.block_extra_keys(self.pool, request, k * n, (k + 1) * n, mm_idx)
                    extra.append(e)
                extra = to_event_extra_keys(extra)
            else:
                extra = [None] * (end - first)
            parent = (self.to_event_hashes([request.block_hashes[first * units_per_key - 1]])[0]
                      if first else None)
            span = (first * n, end * n)
            token_ids = tokens.get(span)
            if token_ids is None:
                token_ids = tokens[span] = request.all_token_ids[span[0] : span[1]]
            self.pool.kv_event_queue.append(
                compat.block_stored_event(
                    self.pool,
                    request,
                    block_hashes=key_hashes,
                    parent_block_hash=parent,
                    token_ids=token_ids,
                    block_size=n,
                    group_idx=group,
                    extra_keys=extra,
                )
            )


def _extend_runs(runs: list[list], first: int, end: int, hashes: list) -> None:
    """Append keys [first, end) with their hashes, merging with the last run when contiguous."""
    if runs and runs[-1][1] == first:
        runs[-1][1] = end
        runs[-1][2] += hashes
    else:
        runs.append([first, end, list(hashes)])


def _decrement(counts: dict, held: list) -> list:
    """Drop one holder of each hash in `held` (counts non-increasing); returns the hashes gone."""
    # the usual case: this block was the only holder of all its units (k == 0)
    k = 0 if counts[held[0]] == 1 else bisect_left(held, True, key=lambda h: counts[h] == 1)
    for h in held[:k]:
        counts[h] -= 1
    gone = held[k:]
    deque(map(counts.pop, gone), maxlen=0)  # bulk delete in C
    return gone


def _tracker(pool: BlockPool, group: int | None = None) -> UnitTracker | None:
    t = pool.__dict__.get("_kvbm_units")
    if t is None or (group is not None and group not in t.units_per_block):
        return None
    return t


def _attach(manager: KVCacheManager) -> None:
    """Attach a UnitTracker to the manager's pool when some group needs sub-block events."""
    pool = manager.block_pool
    if not (pool.enable_kv_cache_events and pool.enable_caching) or config.plugin_disabled():
        return
    B = pool.hash_block_size
    units_per_block = {}
    for g, (group, (kind, _)) in enumerate(
        zip(manager.kv_cache_config.kv_cache_groups, manager.kv_cache_event_metadata)
    ):
        P = group.kv_cache_spec.block_size
        if kind in _FULL_ATTENTION_KINDS and P > B and P % B == 0:
            units_per_block[g] = P // B
    if not units_per_block:
        return
    if compat.hash_lookahead_tokens(pool):
        logger.warning("KVBM sub-block events are off: EAGLE hash lookahead is not supported yet")
        return
    coarse = config.coarse_events()
    pool._kvbm_units = UnitTracker(pool, units_per_block, coarse)
    logger.info(
        "KVBM: KV events per %d-token hash unit for groups %s (coarse block events %s)",
        B,
        sorted(units_per_block),
        "kept" if coarse else "suppressed",
    )


def apply() -> bool:
    changed = wrap_method(KVCacheManager, "__init__", _wrap_manager_init)
    changed |= wrap_method(BlockPool, "cache_full_blocks", _wrap_cache_full_blocks)
    changed |= wrap_method(BlockPool, "cache_partial_block", _wrap_cache_partial_block)
    changed |= wrap_method(BlockPool, "_maybe_evict_cached_block", _wrap_evict)
    changed |= wrap_method(BlockPool, "move_block_hashes", _wrap_move)
    changed |= wrap_method(BlockPool, "reset_prefix_cache", _wrap_reset)
    changed |= wrap_method(BlockPool, "_emit_block_removed_events", _wrap_emit_removed)
    return changed


def _wrap_manager_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        _attach(self)

    return __init__


def _without_vllm_events(pool: BlockPool, call):
    """Run `call` with the pool's own event emission off: the tracker announces these groups."""
    pool.enable_kv_cache_events = False
    try:
        return call()
    finally:
        pool.enable_kv_cache_events = True


def _wrap_cache_full_blocks(orig):
    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, block_mask=None):
        t = _tracker(self, kv_cache_group_id)
        args = (self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                kv_cache_group_id, block_mask)
        if t is None:
            return orig(*args)
        _without_vllm_events(self, lambda: orig(*args))
        if num_cached_blocks < num_full_blocks:
            t.cache(request, kv_cache_group_id, blocks, num_cached_blocks, num_full_blocks,
                    mask=block_mask)

    return cache_full_blocks


def _wrap_cache_partial_block(orig):
    def cache_partial_block(self, request, block, num_tokens, kv_cache_group_id, block_size,
                            replace_existing_hashes=False):
        t = _tracker(self, kv_cache_group_id)
        args = (self, request, block, num_tokens, kv_cache_group_id, block_size,
                replace_existing_hashes)
        if t is None:
            return orig(*args)
        if replace_existing_hashes:
            t.release(block.block_id)
        key = _without_vllm_events(self, lambda: orig(*args))
        if key is not None:
            block_idx = num_tokens // block_size
            t.cache(request, kv_cache_group_id, {block_idx: block}, block_idx, block_idx + 1,
                    n_last=(num_tokens - block_idx * block_size) // t.unit)
        return key

    return cache_partial_block


def _wrap_evict(orig):
    def _maybe_evict_cached_block(self, block):
        evicted = orig(self, block)
        t = _tracker(self)
        if t is not None:
            t.release(block.block_id)
        return evicted

    return _maybe_evict_cached_block


def _wrap_move(orig):
    def move_block_hashes(self, src_block, dst_block):
        orig(self, src_block, dst_block)
        t = _tracker(self)
        if t is not None:
            t.move(src_block.block_id, dst_block.block_id)

    return move_block_hashes


def _wrap_reset(orig):
    def reset_prefix_cache(self):
        ok = orig(self)
        t = _tracker(self)
        if ok and t is not None:
            t.clear()
        return ok

    return reset_prefix_cache


def _wrap_emit_removed(orig):
    def _emit_block_removed_events(self, block_hashes):
        t = _tracker(self)
        if t is not None:  # removals of these groups come from the tracker
            block_hashes = [k for k in block_hashes if get_group_id(k) not in t.units_per_block]
        return orig(self, block_hashes)

    return _emit_block_removed_events
