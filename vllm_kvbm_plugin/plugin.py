"""vLLM general-plugin entry point (`vllm.general_plugins` → `kvbm`).

vLLM calls `register()` once in every process it starts (front end, EngineCore, workers) before
it builds schedulers or workers. It must stay cheap and idempotent. vLLM configures logging only
after the front end has loaded plugins, so the one line saying what was applied is logged by
EngineCore when it sets up the KV cache (see patches/hash_granularity.py), from
`patches.APPLIED`.
"""

from __future__ import annotations

from vllm_kvbm_plugin import config


def register() -> None:
    if config.plugin_disabled():
        return
    from vllm_kvbm_plugin.patches import APPLIED, apply_all

    APPLIED.extend(apply_all())
