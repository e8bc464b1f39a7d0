"""The tiers below the CPU tier, in lookup order (fastest first): the built-in disk and remote
tiers, then those named by the `tier_module_paths` setting. Both sides build their halves from
this one list, so a tier's scheduler and worker halves are always registered together."""

from __future__ import annotations

import importlib

from vllm_kvbm_plugin.config import CONNECTOR_NAME, KVBMConfig
from vllm_kvbm_plugin.connector.base import TierModule
from vllm_kvbm_plugin.connector.disk_scheduler import DiskTier
from vllm_kvbm_plugin.connector.disk_worker import DiskWorker, disk_peaks
from vllm_kvbm_plugin.connector.remote_scheduler import SERIES as REMOTE_SERIES
from vllm_kvbm_plugin.connector.remote_scheduler import RemoteTier
from vllm_kvbm_plugin.connector.remote_worker import RemoteWorker, remote_peaks

BUILT_IN = (
    TierModule(DiskTier.create, DiskWorker.open, disk_peaks),
    TierModule(RemoteTier.create, RemoteWorker.open, remote_peaks, REMOTE_SERIES),
)


def tier_modules(cfg: KVBMConfig) -> tuple[TierModule, ...]:
    """BUILT_IN, then each module of cfg.tier_module_paths' `TIER`; a module that cannot be
    imported or defines no TierModule fails the engine's startup, naming it."""
    return BUILT_IN + tuple(_load(path) for path in cfg.tier_module_paths)


def _load(path: str) -> TierModule:
    try:
        module = importlib.import_module(path)
    except ImportError as e:
        raise ValueError(f"{CONNECTOR_NAME}: tier_module_paths: cannot import {path!r} ({e})") from None
    tier = getattr(module, "TIER", None)
    if not isinstance(tier, TierModule):
        raise ValueError(f"{CONNECTOR_NAME}: tier_module_paths: {path!r} defines no TIER "
                         "(a vllm_kvbm_plugin.connector.base.TierModule)")
    return tier
