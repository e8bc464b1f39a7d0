"""Our tiers and policies inside vLLM's own offloading stack (OffloadingConnector).

- `LineageCachePolicy`, `MultiLRUCachePolicy`: vLLM CachePolicy classes
  (`"eviction_policy": ..., "cache_policy_module_path": "vllm_kvbm_plugin.offloading"`).
- `KVBMDiskTier`: a vLLM SecondaryTierManager over our disk block format
  (`"secondary_tiers": [{"type": "KVBMDiskTier", "module_path": "vllm_kvbm_plugin.offloading",
  "path": DIR, "bytes_to_use": N}]`).
- `KVBMRemoteTier`: a vLLM SecondaryTierManager on Redis / Valkey with our remote value format
  (`"secondary_tiers": [{"type": "KVBMRemoteTier", "module_path": "vllm_kvbm_plugin.offloading",
  "url": "redis://HOST:PORT/0"}]`).
- `KVBMOffloadingSpec`: vLLM's tiering spec with our defaults, and a worker of ours on the CPU
  platform (`"spec_name": "KVBMOffloadingSpec", "spec_module_path": "vllm_kvbm_plugin.offloading"`).

vLLM's factories import this module and take the class by name, so every class is exported here.
"""

from vllm_kvbm_plugin.offloading.disk_tier import KVBMDiskTier
from vllm_kvbm_plugin.offloading.policies import LineageCachePolicy, MultiLRUCachePolicy
from vllm_kvbm_plugin.offloading.remote_tier import KVBMRemoteTier
from vllm_kvbm_plugin.offloading.spec import KVBMCPUWorker, KVBMOffloadingSpec

__all__ = ["KVBMCPUWorker", "KVBMDiskTier", "KVBMOffloadingSpec", "KVBMRemoteTier", "LineageCachePolicy",
           "MultiLRUCachePolicy"]
