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
- a request with `kv_cache_report_mode` "full" has its prefix-cache hit announced again, per unit
  up to the hit (vLLM would announce every group's hit blocks as whole, even one the hit ends in);
- for these groups vLLM's own Stored/Removed events are replaced (the pool's emission is switched
  off around vLLM's caching calls): the partial-tail ones are dropped (our units cover them) and
  the coarse P-sized ones are re-emitted by the same announce-once bookkeeping, so a recomputed
  block is not announced twice. KVBM_COARSE_EVENTS=0 drops the coarse ones entirely.

Mamba / linear-attention groups are left exactly as vLLM emits them.

The bookkeeping (which units each block holds, and the events that follow) is
`events.unit_tracker.UnitTracker`, which imports no vLLM: this module binds vLLM's event API to it
(`apply`), builds one per BlockPool (`_attach`) and calls it from the wrappers below.
"""

from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import to_event_extra_keys
from vllm.v1.request import Request

from vllm_kvbm_plugin import compat, config
from vllm_kvbm_plugin.events.unit_tracker import UnitTracker, VllmEventApi
from vllm_kvbm_plugin.patches.wrapping import add_class_default, logger, wrap_method

NAME = "sub_block_events"
_FULL_ATTENTION_KINDS = ("full_attention", "mla_attention")


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
    tracker = pool._kvbm_units = UnitTracker(pool, units_per_block, coarse)  # type: ignore[attr-defined]  # ours: add_class_default
    convert = tracker.to_event_hashes  # `list` when event hashes are vLLM's bytes: nothing to keep
    UnitTracker.convert_on_hashing = None if convert is list else convert
    logger.info(
        "KVBM: KV events per %d-token hash unit for groups %s (coarse block events %s)",
        B,
        sorted(units_per_block),
        "kept" if coarse else "suppressed",
    )


def vllm_event_api() -> VllmEventApi:
    """vLLM's event API, as a UnitTracker builds its events with it."""
    return VllmEventApi(BlockStored, BlockRemoved, to_event_extra_keys, compat.block_extra_keys,
                        compat.has_extra_keys, compat.event_hash_converter)


def apply() -> bool:
    UnitTracker.vllm = vllm_event_api()
    # Per-instance state, None unless set: a pool's tracker; a request's hashes in event form
    changed = add_class_default(BlockPool, "_kvbm_units", None)
    changed |= add_class_default(Request, "_kvbm_event_hashes", None)
    changed |= wrap_method(KVCacheManager, "__init__", _wrap_manager_init)
    changed |= wrap_method(KVCacheManager, "get_computed_blocks", _wrap_get_computed_blocks)
    changed |= wrap_method(BlockPool, "cache_full_blocks", _wrap_cache_full_blocks)
    changed |= wrap_method(BlockPool, "cache_partial_block", _wrap_cache_partial_block)
    changed |= wrap_method(BlockPool, "_maybe_evict_cached_block", _wrap_evict)
    changed |= wrap_method(BlockPool, "move_block_hashes", _wrap_move)
    changed |= wrap_method(BlockPool, "reset_prefix_cache", _wrap_reset)
    changed |= wrap_method(BlockPool, "take_events", _wrap_take_events)
    changed |= wrap_method(Request, "update_block_hashes", _wrap_update_block_hashes)
    return changed


def _wrap_update_block_hashes(orig):
    """vLLM only appends to a request's hashes here; elsewhere it truncates them (streaming input
    sessions, resets), which the converted list follows at the next call (and
    `UnitTracker.event_hashes` ignores until then: the lengths differ)."""

    def update_block_hashes(self):
        convert = UnitTracker.convert_on_hashing
        if convert is None:
            return orig(self)
        hashes = self.block_hashes
        n = len(hashes)
        orig(self)
        converted = self._kvbm_event_hashes
        if converted is None or len(converted) < n:
            self._kvbm_event_hashes = convert(hashes)
            return
        if len(converted) > n:
            del converted[n:]
        if len(hashes) > n:
            converted += convert(hashes[n:])

    return update_block_hashes


def _wrap_manager_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        _attach(self)

    return __init__


# For tracked groups the pool's own event emission is switched off around vLLM's calls: the
# tracker announces (and removes) those keys. A tracked block holds only its group's keys.


def _wrap_cache_full_blocks(orig):
    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, block_mask=None):
        t = self._kvbm_units
        if t is None:
            return orig(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                        kv_cache_group_id, block_mask)
        if kv_cache_group_id not in t.units_per_block:
            queue = self.kv_event_queue
            n = len(queue)
            orig(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                 kv_cache_group_id, block_mask)
            if len(queue) > n:  # vLLM's BlockStored for this range: reuse its token list
                first, end = num_cached_blocks * block_size, num_full_blocks * block_size
                token_ids = queue[-1].token_ids
                if len(token_ids) == end - first:
                    t.recent_tokens = (request, first, end, token_ids)
            return None
        self.enable_kv_cache_events = False
        try:
            orig(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                 kv_cache_group_id, block_mask)
        finally:
            self.enable_kv_cache_events = True
        if num_cached_blocks < num_full_blocks:
            t.cache(request, kv_cache_group_id, blocks, num_cached_blocks, num_full_blocks,
                    mask=block_mask)

    return cache_full_blocks


def _wrap_cache_partial_block(orig):
    def cache_partial_block(self, request, block, num_tokens, kv_cache_group_id, block_size,
                            replace_existing_hashes=False):
        t = self._kvbm_units
        if t is None or kv_cache_group_id not in t.units_per_block:
            return orig(self, request, block, num_tokens, kv_cache_group_id, block_size,
                        replace_existing_hashes)
        if replace_existing_hashes:
            t.release(block.block_id)
        self.enable_kv_cache_events = False
        try:
            key = orig(self, request, block, num_tokens, kv_cache_group_id, block_size,
                       replace_existing_hashes)
        finally:
            self.enable_kv_cache_events = True
        if key is not None:
            block_idx = num_tokens // block_size
            t.cache_partial(request, kv_cache_group_id, block, block_idx,
                            (num_tokens - block_idx * block_size) // t.unit)
        return key

    return cache_partial_block


def _wrap_get_computed_blocks(orig):
    """A request with `kv_cache_report_mode` "full" has its prefix-cache hit announced again. vLLM
    announces every group's hit blocks as whole blocks, counting a block the hit ends inside
    (a partial key: hash unit < block) as whole; for a Mamba group that block's full hash may not
    exist yet (IndexError) or is not cached. Here: tracked groups per unit up to the hit, the
    others by vLLM for their whole hit blocks only."""

    def get_computed_blocks(self, request, *args, **kwargs):
        t = self.block_pool._kvbm_units
        if t is None or getattr(request, "kv_cache_report_mode", None) != "full":
            return orig(self, request, *args, **kwargs)
        request.kv_cache_report_mode = "incremental"
        try:
            result = orig(self, request, *args, **kwargs)
        finally:
            request.kv_cache_report_mode = "full"
        hit = result[1]
        if hit:
            for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
                if g in t.units_per_block:
                    t.cache_hit(request, g, hit // t.unit)
                else:
                    size = group.kv_cache_spec.block_size
                    self.block_pool.emit_cached_block_events(request, hit // size, size, g)
        return result

    return get_computed_blocks


def _wrap_evict(orig):
    def _maybe_evict_cached_block(self, block):
        t = self._kvbm_units
        if t is None or block.block_id not in t.by_block:
            return orig(self, block)
        self.enable_kv_cache_events = False
        try:
            evicted = orig(self, block)
        finally:
            self.enable_kv_cache_events = True
        t.release(block.block_id)
        return evicted

    return _maybe_evict_cached_block


def _wrap_move(orig):
    def move_block_hashes(self, src_block, dst_block):
        orig(self, src_block, dst_block)
        t = self._kvbm_units
        if t is not None:
            t.move(src_block.block_id, dst_block.block_id)

    return move_block_hashes


def _wrap_reset(orig):
    def reset_prefix_cache(self):
        ok = orig(self)
        t = self._kvbm_units
        if ok and t is not None:
            t.clear()
        return ok

    return reset_prefix_cache


def _wrap_take_events(orig):
    def take_events(self):
        t = self._kvbm_units
        if t is not None and (t.removed_units or t.removed_coarse):
            t.flush_removed()
        return orig(self)

    return take_events
