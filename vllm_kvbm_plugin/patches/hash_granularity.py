"""Keep the user's --block-size as the hash granularity when vLLM inflates a hybrid model's block.

vLLM raises the attention block of Mamba+attention models until the attention page is at least
the Mamba page (`Platform._align_hybrid_block_size`, reached through
`update_block_size_for_backend`), and `resolve_kv_cache_block_sizes` then hashes at the inflated
size unless `prefix_match_unit` is set (vllm/v1/core/kv_cache_utils.py, 0.32/0.33). We
1. record the block size the user asked for before the platform inflates it (in uniproc mode the
   inflation mutates the config EngineCore later reads; in multiproc mode the worker inflates its
   own copy and EngineCore's copy still holds the user's value);
2. in `EngineCore._initialize_kv_caches`, set `cache_config.prefix_match_unit` to that size when
   it is smaller than the inflated block and every group accepts it, so EngineCore, the scheduler
   and (through `kv_cache_config.hash_block_size`) the workers all hash at it;
3. add `hash_block_size` to `EngineCore.get_kv_cache_group_metadata()` for event consumers.
An explicit --prefix-match-unit always wins; KVBMConnector's `hash_block_size` comes next.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_kvbm_plugin import __version__, config
from vllm_kvbm_plugin.patches.wrapping import APPLIED, logger, wrap_method

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.engine.core import EngineCore

NAME = "hash_granularity"
_RECORD = "_kvbm_user_block_size"


def apply() -> bool:
    from vllm.platforms import current_platform
    from vllm.v1.engine.core import EngineCore

    changed = wrap_method(type(current_platform), "update_block_size_for_backend", _wrap_update)
    changed |= wrap_method(EngineCore, "_initialize_kv_caches", _wrap_init_kv_caches)
    changed |= wrap_method(EngineCore, "get_kv_cache_group_metadata", _wrap_group_metadata)
    return changed


def _wrap_update(orig):
    def update_block_size_for_backend(cls, vllm_config):
        cc = vllm_config.cache_config
        before = cc.block_size
        orig(cls, vllm_config)
        if cc.user_specified_block_size and cc.block_size != before and getattr(cc, _RECORD, None) is None:
            setattr(cc, _RECORD, before)

    return update_block_size_for_backend


def _wrap_init_kv_caches(orig):
    def _initialize_kv_caches(self, vllm_config):
        if APPLIED:
            logger.info("vllm-kvbm-plugin %s: patches applied: %s", __version__, ", ".join(APPLIED))
        unit = _preferred_unit(self, vllm_config)
        if unit is None:
            return orig(self, vllm_config)
        cc = vllm_config.cache_config
        cc.prefix_match_unit = unit
        kv_cache_config = orig(self, vllm_config)
        if kv_cache_config.hash_block_size == unit:
            logger.info(
                "KVBM: attention block size is %d tokens so that attention page size is >= mamba "
                "page size (hash granularity preserved at %d)",
                cc.block_size,
                unit,
            )
        else:
            logger.warning(
                "KVBM: vLLM hashes at %s tokens, not %d: it keeps the block size when prefix "
                "caching and KV connectors are off or a Mamba group is not in 'align' mode",
                kv_cache_config.hash_block_size,
                unit,
            )
        return kv_cache_config

    return _initialize_kv_caches


def _preferred_unit(engine_core: EngineCore, vllm_config: VllmConfig) -> int | None:
    """The hash granularity to impose, or None to leave vLLM's choice alone."""
    if config.plugin_disabled():
        return None
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    kvbm = config.connector_config(vllm_config)  # validates our keys at startup
    if mc is None or not mc.is_hybrid or cc.prefix_match_unit is not None:
        return None
    events = vllm_config.kv_events_config
    if not (cc.enable_prefix_caching or (events and events.enable_kv_cache_events) or kvbm is not None):
        return None
    unit = kvbm.hash_block_size if kvbm is not None else None
    if unit is None and cc.user_specified_block_size:
        unit = getattr(cc, _RECORD, cc.block_size)
    if unit is None:
        return None
    sizes = {
        spec.block_size
        for worker_specs in engine_core.model_executor.get_kv_cache_specs()
        for spec in worker_specs.values()
        if getattr(spec, "prefix_cacheable", True)
    }
    if not sizes or max(sizes) == unit:
        return None  # nothing was inflated
    bad = sorted(s for s in sizes if s % unit)
    if bad:
        logger.warning(
            "KVBM: cannot hash at %d tokens: KV cache block sizes %s are not multiples of it; "
            "keeping vLLM's hash granularity",
            unit,
            bad,
        )
        return None
    return unit


def _wrap_group_metadata(orig):
    def get_kv_cache_group_metadata(self):
        metadata = orig(self)
        hbs = getattr(self.scheduler, "hash_block_size", None)
        for entry in metadata:
            entry["hash_block_size"] = hbs
        return metadata

    return get_kv_cache_group_metadata
