"""vLLM general-plugin entry point (`vllm.general_plugins` → `kvbm`).

vLLM calls `register()` once in every process it starts (front end, EngineCore, workers) before
it builds schedulers or workers. It must stay cheap and idempotent.
"""

from __future__ import annotations

import os

from vllm_kvbm_plugin import config


def register() -> None:
    if config.plugin_disabled():
        return
    from vllm.logger import init_logger

    from vllm_kvbm_plugin.patches import apply_all

    applied = apply_all()
    if applied:
        init_logger("vllm_kvbm_plugin").info(
            "vllm-kvbm-plugin: applied patches %s in pid %d (inert unless KV events, prefix "
            "caching on a hybrid model or KVBMConnector are configured)",
            ", ".join(applied),
            os.getpid(),
        )
