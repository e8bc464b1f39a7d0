"""KV events per hash unit for full-attention groups whose block vLLM inflated (hybrid models).

vLLM announces a full-attention group only per (inflated) block, plus one "partial tail" key at the
last prompt hash boundary whose parent was never announced (vllm/v1/core/block_pool.py,
`cache_full_blocks` and `cache_partial_block`, 0.32 and 0.33). When the group's block P is larger
than `hash_block_size` B we announce every B-token unit that vLLM caches instead:

- a unit is cached when its block gets a full key (all P/B units) or a partial-tail key (the units
  up to that boundary); it is announced once while any physical block holds it (`Holders`),
  chained to the previous unit;
- when vLLM evicts or reuses the block (`_maybe_evict_cached_block`) its units are released and
  the last holder's release becomes a BlockRemoved; `reset_prefix_cache` forgets everything (vLLM
  already emits AllBlocksCleared);
- vLLM's own partial-tail Stored/Removed events for these groups are dropped (our units cover them);
  the coarse P-sized events stay unless VLLM_KVBM_COARSE_EVENTS=0.

Mamba / linear-attention groups are left exactly as vLLM emits them.
"""

from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_group_id, maybe_convert_block_hash

from vllm_kvbm_plugin import compat, config
from vllm_kvbm_plugin.events.holders import Holders
from vllm_kvbm_plugin.patches import logger, wrap_method

NAME = "sub_block_events"
_FULL_ATTENTION_KINDS = ("full_attention", "mla_attention")


class UnitTracker:
    """Which hash units each physical block holds, per sub-block group of one BlockPool."""

    def __init__(self, pool: BlockPool, units_per_block: dict[int, int], coarse: bool):
        self.pool = pool
        self.unit = pool.hash_block_size
        self.units_per_block = units_per_block  # group id -> P // B
        self.coarse = coarse
        self.units_by_block: dict[int, tuple[int, list]] = {}  # block id -> (group, unit hashes)
        self.holders = Holders()  # (group, unit hash)
        self.partial_keys: set = set()  # vLLM partial-tail keys whose events we hide

    def hold(self, request, block, group: int, block_idx: int, n_units: int) -> None:
        """Record that `block` (block_idx of the request) now holds its first n_units units."""
        if block.is_null or n_units <= 0:
            return
        entry = self.units_by_block.get(block.block_id)
        if entry is None:
            entry = self.units_by_block[block.block_id] = (group, [])
        held = entry[1]
        first = block_idx * self.units_per_block[group]
        fresh = []
        for u in range(first + len(held), first + n_units):
            h = request.block_hashes[u]
            held.append(h)
            if self.holders.hold((group, h)):
                fresh.append(u)
        self._announce(request, group, fresh)

    def release(self, block_id: int) -> None:
        entry = self.units_by_block.pop(block_id, None)
        if entry is None:
            return
        group, held = entry
        gone = [maybe_convert_block_hash(h) for h in held if self.holders.release((group, h))]
        if gone and self.pool.enable_kv_cache_events:
            self.pool.kv_event_queue.append(
                BlockRemoved(block_hashes=gone, medium=self.pool.medium, group_idx=group)
            )

    def move(self, src_id: int, dst_id: int) -> None:
        entry = self.units_by_block.pop(src_id, None)
        if entry is not None:
            self.units_by_block[dst_id] = entry

    def clear(self) -> None:
        self.units_by_block.clear()
        self.holders.clear()
        self.partial_keys.clear()

    def hides_removal(self, key) -> bool:
        """Whether vLLM's BlockRemoved for `key` is one of the events our units replace."""
        if get_group_id(key) not in self.units_per_block:
            return False
        if key in self.partial_keys:
            if self.pool.cached_block_hash_to_block.get_one_block(key) is None:
                self.partial_keys.discard(key)
            return True
        return not self.coarse

    def _announce(self, request, group: int, units: list[int]) -> None:
        """One BlockStored per run of consecutive fresh units, chained to the unit before."""
        B = self.unit
        i = 0
        while i < len(units):
            j = i
            while j + 1 < len(units) and units[j + 1] == units[j] + 1:
                j += 1
            first, last = units[i], units[j]
            extra, mm_idx = [], 0
            for u in range(first, last + 1):
                keys, mm_idx = compat.block_extra_keys(self.pool, request, u * B, (u + 1) * B, mm_idx)
                extra.append(keys)
            parent = maybe_convert_block_hash(request.block_hashes[first - 1]) if first else None
            self.pool.kv_event_queue.append(
                compat.build_block_stored(
                    self.pool,
                    request,
                    block_hashes=[maybe_convert_block_hash(h) for h in request.block_hashes[first : last + 1]],
                    parent_block_hash=parent,
                    start_token_idx=first * B,
                    end_token_idx=(last + 1) * B,
                    block_size=B,
                    kv_cache_group_id=group,
                    extra_keys_list=extra,
                )
            )
            i = j + 1


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


def _wrap_cache_full_blocks(orig):
    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, block_mask=None):
        t = _tracker(self, kv_cache_group_id)
        n0 = len(self.kv_event_queue)
        orig(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
             kv_cache_group_id, block_mask)
        if t is None or num_cached_blocks >= num_full_blocks:
            return
        if not t.coarse:
            q = self.kv_event_queue
            q[n0:] = [e for e in q[n0:] if not isinstance(e, BlockStored)]
        r = t.units_per_block[kv_cache_group_id]
        for i in range(num_cached_blocks, num_full_blocks):
            if block_mask is None or block_mask[i - num_cached_blocks]:
                t.hold(request, blocks[i], kv_cache_group_id, i, r)

    return cache_full_blocks


def _wrap_cache_partial_block(orig):
    def cache_partial_block(self, request, block, num_tokens, kv_cache_group_id, block_size,
                            replace_existing_hashes=False):
        t = _tracker(self, kv_cache_group_id)
        if t is not None and replace_existing_hashes:
            t.release(block.block_id)
        n0 = len(self.kv_event_queue)
        key = orig(self, request, block, num_tokens, kv_cache_group_id, block_size,
                   replace_existing_hashes)
        if t is None or key is None:
            return key
        t.partial_keys.add(key)
        q = self.kv_event_queue
        q[n0:] = [e for e in q[n0:] if not isinstance(e, BlockStored)]
        block_idx = num_tokens // block_size
        t.hold(request, block, kv_cache_group_id, block_idx, (num_tokens - block_idx * block_size) // t.unit)
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
        if t is not None:
            block_hashes = [k for k in block_hashes if not t.hides_removal(k)]
        return orig(self, block_hashes)

    return _emit_block_removed_events
