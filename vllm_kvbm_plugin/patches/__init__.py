"""Every monkeypatch of vLLM lives here, one module per concern, and nothing else does.

- `hash_granularity`: keep the user's --block-size as the hash granularity of hybrid models.
- `sub_block_events`: KV events per hash unit for inflated full-attention blocks (the
  bookkeeping is `events.unit_tracker.UnitTracker`; this module only wires it into vLLM).
- `offload_events`: image keys on, and parents-first order of, the OffloadingConnector's tier events.
- `pic_blend`: the selective recompute of position-independent loads, in CPU attention.
- `pic_segments`: a step computing several query segments of a request, loaded runs between them.
- `wrapping`: the tools every patch uses (`wrap_method`, `add_class_default`, `remove_all`).

Rules: patch methods on class objects (never module attributes, which other modules import by
value); be idempotent (a second apply is a no-op); gate on the vLLM versions we read; each wrapper is
inert unless its feature is configured, so an installed but unconfigured plugin changes nothing;
state kept on vLLM's objects is read through a class default (`add_class_default`), never through
the object's `__dict__`. Patch modules import their tools from `patches.wrapping`, not from this
package, so that no patch module and `apply_all` import each other.
"""

from __future__ import annotations

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.patches.wrapping import APPLIED, add_class_default, logger, remove_all, wrap_method

__all__ = ["APPLIED", "add_class_default", "apply_all", "remove_all", "wrap_method"]


def apply_all() -> list[str]:
    """Apply every patch for the installed vLLM; returns the names applied in this call."""
    if not compat.is_supported():
        logger.warning(
            "vllm-kvbm-plugin supports vLLM %s; found %s: no patches applied",
            "/".join(compat.SUPPORTED),
            compat.vllm_minor(),
        )
        return []
    from vllm_kvbm_plugin.patches import hash_granularity, offload_events, pic_blend, pic_segments, sub_block_events

    applied = []
    for module in (hash_granularity, sub_block_events, offload_events, pic_blend, pic_segments):
        if module.apply():
            applied.append(module.NAME)
    return applied
