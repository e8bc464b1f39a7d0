"""Plugin settings: environment variables for the patches, and the connector's extra config.

Environment (read when used, so tests and subprocesses can set them late):
  KVBM_DISABLE=1        the plugin applies no patch at all (vLLM behaves as without it)
  KVBM_COARSE_EVENTS=0  hybrid models: drop the inflated-block events of full-attention groups
                        and keep only the per-hash-unit ones (default 1: keep both)
  KVBM_KEY_SECRET=<32 hex> the block-key secret every instance sharing a tier uses (else one kept
                        in the remote store or disk_path: tiers/secret.py)
  KVBM_REMOTE_PASSWORD  the remote tier's password when remote_url carries none (kept out of
                        kv_transfer_config, which vLLM logs: tiers/resp.py)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
import os

if TYPE_CHECKING:
    from vllm.config import VllmConfig

CONNECTOR_NAME = "KVBMConnector"
DERIVED = ("pic_model",)  # KVBMConfig fields filled from the model, never from the user
REMOTE_EVENTS = ("announcer", "instance")


@dataclasses.dataclass(frozen=True)
class KVBMConfig:
    """`kv_connector_extra_config` of KVBMConnector, validated (`from_extra`). Sizes are bytes.

    Read in every process that builds the connector (EngineCore's scheduler side, each worker) and
    by the hash-granularity patch in EngineCore (`connector_config`); frozen, so both sides of a
    connector see the same settings. `pic_model` is derived from the model, never set by the user."""

    cpu_bytes_to_use: int = 1 << 30  # CPU tier size
    disk_path: str | None = None  # disk tier directory (off when unset)
    disk_bytes_to_use: int = 16 << 30  # disk tier bound
    eviction_policy: str = "lru"  # lru | lineage | multi_lru
    hash_block_size: int | None = None  # hybrid models: hash granularity (default: --block-size)
    offload_prompt_only: bool = False  # store only blocks made of prompt tokens
    disk_fsync: bool = False  # fsync each block file before it counts as stored
    remote_url: str | None = None  # shared remote tier: redis://, rediss://, unix://, redis+cluster://h:p,h:p (off when unset)
    remote_lookup_budget_ms: float = 5.0  # per scheduler step, waiting for remote lookups
    # derived from the model where the connector is built (connector/pic_model.py
    # with_model_support), not a setting: a PicModel when position-independent loads can
    # re-rotate its K, else why not (a string)
    pic_model: object = dataclasses.field(default=None, compare=False, repr=False)
    # who announces the remote tier's entries: "announcer" (`vllm-kvbm announce`, once per tier,
    # server evictions included) or "instance" (each instance its own writes; a lone instance)
    remote_events: str = "announcer"
    # position-independent loads (connector/pic_planner.py): the share of a salted request's reused tokens
    # recomputed (patches/pic_blend.py; 0.15 is CacheBlend's); 0: the loaded KV is used as is. Off
    # by default: the recompute runs every reused token through the model (no TTFT gain left)
    pic_recompute_ratio: float = 0.0
    # index the CPU tier's blocks for position-independent loads from startup; off: from the first
    # `kvbm-pic:` request on (until then no request could use the index: docs/reuse.md)
    pic_index_always: bool = False
    # measure this machine's peak per transfer kind when the worker starts (tiers/roofline.py, a few
    # seconds): the log line and vllm:kvbm_transfer_peak_bytes_per_second then show the share reached
    measure_roofline: bool = False
    # modules that each add a tier below the built-in ones, in lookup order: each defines
    # `TIER`, a connector.base.TierModule (its scheduler and worker halves; docs/architecture.md)
    tier_module_paths: tuple[str, ...] = ()

    @classmethod
    def from_extra(cls, extra: dict | None) -> "KVBMConfig":
        from vllm_kvbm_plugin.tiers.policies import POLICIES

        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in DERIVED}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(
                f"{CONNECTOR_NAME}: unknown kv_connector_extra_config keys {unknown}; "
                f"valid keys: {', '.join(fields)}"
            )
        cfg = cls(**extra)
        for name in ("cpu_bytes_to_use", "disk_bytes_to_use", "hash_block_size"):
            v = getattr(cfg, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{CONNECTOR_NAME}: {name} must be a positive integer, got {v!r}")
        if cfg.eviction_policy not in POLICIES:
            raise ValueError(
                f"{CONNECTOR_NAME}: eviction_policy {cfg.eviction_policy!r} is not one of "
                f"{', '.join(POLICIES)}"
            )
        if cfg.remote_url is not None:
            from vllm_kvbm_plugin.tiers.resp import check_url

            try:
                check_url(cfg.remote_url)
            except ValueError as e:
                raise ValueError(f"{CONNECTOR_NAME}: {e}") from None
        b = cfg.remote_lookup_budget_ms
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0 <= b <= 1000:
            raise ValueError(f"{CONNECTOR_NAME}: remote_lookup_budget_ms must be a number of ms in [0, 1000], "
                             f"got {b!r}")
        if cfg.remote_events not in REMOTE_EVENTS:
            raise ValueError(f"{CONNECTOR_NAME}: remote_events must be one of {', '.join(REMOTE_EVENTS)}, "
                             f"got {cfg.remote_events!r}")
        r = cfg.pic_recompute_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 <= r <= 1:
            raise ValueError(f"{CONNECTOR_NAME}: pic_recompute_ratio must be a number in [0, 1], got {r!r}")
        for name in ("offload_prompt_only", "disk_fsync", "measure_roofline", "pic_index_always"):
            if not isinstance(getattr(cfg, name), bool):
                raise ValueError(f"{CONNECTOR_NAME}: {name} must be true or false, got {getattr(cfg, name)!r}")
        paths = cfg.tier_module_paths
        if not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) and p for p in paths):
            raise ValueError(f"{CONNECTOR_NAME}: tier_module_paths must be a list of module paths, got {paths!r}")
        cfg = dataclasses.replace(cfg, tier_module_paths=tuple(paths))
        if cfg.disk_path is not None and not isinstance(cfg.disk_path, str):
            raise ValueError(f"{CONNECTOR_NAME}: disk_path must be a string path")
        if os.environ.get("KVBM_KEY_SECRET"):  # a malformed one fails here, before the engine starts
            from vllm_kvbm_plugin.tiers.secret import ENV, parse

            parse(os.environ[ENV], f"{CONNECTOR_NAME}: {ENV}")
        return cfg


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


def connector_config(vllm_config: VllmConfig) -> KVBMConfig | None:
    """Our connector's validated config, or None when KVBMConnector is not configured.

    Unknown keys fail here, naming the valid ones, so a typo never silently changes nothing.
    Fields derived from the model (`pic_model`) are left unset: they are filled where the
    connector is built (KVBMConnector), which knows the model.
    """
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or ktc.kv_connector != CONNECTOR_NAME:
        return None
    return KVBMConfig.from_extra(ktc.kv_connector_extra_config)
