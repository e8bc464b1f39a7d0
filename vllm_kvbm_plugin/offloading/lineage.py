"""Which offload key precedes another in its request: the parent a lineage policy links it to.

vLLM's OffloadKey is a block hash plus a 4-byte KV cache group; the hash chain itself cannot be
walked backwards, but the OffloadingConnector records every key's end-token position in the
request's ReqContext. The parent of a key is the key of the same group that ends right before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm_kvbm_plugin import compat

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext


@dataclasses.dataclass
class _RequestLineage:
    """Per request (kept in its ReqContext): each key's parent, rebuilt when the connector has
    named more keys since (once per step and request, not once per stored chunk)."""
    known: int = 0
    parents: dict[OffloadKey, OffloadKey | None] = dataclasses.field(default_factory=dict)  # key -> parent key or None


def _parents(req_context: ReqContext) -> dict[OffloadKey, OffloadKey | None]:
    positions = compat.offload_key_positions(req_context)
    state = req_context.get_state(_RequestLineage)
    if state is None or state.known != len(positions):
        by_group: dict[bytes, list[tuple[int, OffloadKey]]] = {}
        for k, p in positions.items():
            by_group.setdefault(k[-4:], []).append((p, k))
        parents: dict[OffloadKey, OffloadKey | None] = {}
        for items in by_group.values():
            items.sort()
            before, last, last_pos = None, None, None
            for p, k in items:
                if p != last_pos:  # keys ending at the same position share the parent before them
                    before, last_pos = last, p
                parents[k] = before
                last = k
        state = _RequestLineage(known=len(positions), parents=parents)
        req_context.set_state(state)
    return state.parents


def parent_in_request(key: OffloadKey, req_context: ReqContext | None) -> OffloadKey | None:
    """The key of `key`'s group that ends right before it in this request, or None (the first
    chunk, or positions unknown)."""
    if req_context is None:
        return None
    return _parents(req_context).get(key)


def parents_in_request(keys: Iterable[OffloadKey],
                       req_context: ReqContext | None) -> dict[OffloadKey, OffloadKey | None]:
    """{key: parent_in_request(key)} for each of `keys`, in their order."""
    if req_context is None:
        return dict.fromkeys(keys)
    parents = _parents(req_context)
    return {key: parents.get(key) for key in keys}
