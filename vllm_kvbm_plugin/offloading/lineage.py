"""Which offload key precedes another in its request: the parent a lineage policy links it to.

vLLM's OffloadKey is a block hash plus a 4-byte KV cache group; the hash chain itself cannot be
walked backwards, but the OffloadingConnector records every key's end-token position in the
request's ReqContext. The parent of a key is the key of the same group that ends right before it.
"""

from __future__ import annotations

import bisect
import dataclasses

from vllm_kvbm_plugin import compat


@dataclasses.dataclass
class _RequestLineage:
    """Per request (kept in its ReqContext): keys by group, sorted by position; rebuilt when the
    connector has named more keys since."""
    known: int = 0
    positions: dict = dataclasses.field(default_factory=dict)  # group -> sorted positions
    keys: dict = dataclasses.field(default_factory=dict)  # group -> keys in position order


def parent_in_request(key: bytes, req_context) -> bytes | None:
    """The key of `key`'s group that ends right before it in this request, or None (the first
    chunk, or positions unknown)."""
    if req_context is None:
        return None
    positions = compat.offload_key_positions(req_context)
    pos = positions.get(key)
    if pos is None:
        return None
    state = req_context.get_state(_RequestLineage)
    if state is None or state.known != len(positions):
        state = _RequestLineage(known=len(positions))
        by_group: dict = {}
        for k, p in positions.items():
            by_group.setdefault(k[-4:], []).append((p, k))
        for g, items in by_group.items():
            items.sort()
            state.positions[g] = [p for p, _ in items]
            state.keys[g] = [k for _, k in items]
        req_context.set_state(state)
    group = key[-4:]
    i = bisect.bisect_left(state.positions[group], pos)
    return state.keys[group][i - 1] if i > 0 else None
