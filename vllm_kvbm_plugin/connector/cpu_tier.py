"""The CPU tier, scheduler side (EngineCore process): a `TierManager` (tier_manager.py) over the
CPU slots of the layout, SchedulerSide's primary tier: the tier whose slots the workers copy to
and from the KV cache, and the tier every other one loads into."""

from __future__ import annotations

from vllm_kvbm_plugin.connector.layout import Layout
from vllm_kvbm_plugin.connector.tier_manager import TierManager
from vllm_kvbm_plugin.events.types import TIER_CPU


def cpu_tier(layout: Layout, policy: str) -> TierManager:
    return TierManager(TIER_CPU, layout.cpu_slots, policy)
