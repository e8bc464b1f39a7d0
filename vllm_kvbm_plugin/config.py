"""Plugin settings: environment variables for the patches, and the connector's extra config.

Environment (read when used, so tests and subprocesses can set them late):
  KVBM_DISABLE=1       the plugin applies no patch at all (vLLM behaves as without it)
  KVBM_COARSE_EVENTS=0 hybrid models: drop vLLM's inflated-block events for full-attention
                            groups and keep only the per-hash-unit ones (default 1: keep both)
"""

from __future__ import annotations

import os

CONNECTOR_NAME = "KVBMConnector"
CONNECTOR_KEYS = ("hash_block_size",)


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def plugin_disabled() -> bool:
    return _flag("KVBM_DISABLE", False)


def coarse_events() -> bool:
    return _flag("KVBM_COARSE_EVENTS", True)


def connector_extra_config(vllm_config) -> dict | None:
    """Our connector's `kv_connector_extra_config`, or None when KVBMConnector is not configured.

    Unknown keys fail here, naming the valid ones, so a typo never silently changes nothing.
    """
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or ktc.kv_connector != CONNECTOR_NAME:
        return None
    extra = dict(ktc.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(CONNECTOR_KEYS))
    if unknown:
        raise ValueError(
            f"{CONNECTOR_NAME}: unknown kv_connector_extra_config keys {unknown}; "
            f"valid keys: {', '.join(CONNECTOR_KEYS)}"
        )
    hbs = extra.get("hash_block_size")
    if hbs is not None and (not isinstance(hbs, int) or isinstance(hbs, bool) or hbs <= 0):
        raise ValueError(f"{CONNECTOR_NAME}: hash_block_size must be a positive integer, got {hbs!r}")
    return extra
