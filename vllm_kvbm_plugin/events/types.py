"""msgspec mirrors of vLLM's KV event wire types (vllm/distributed/kv_events.py, 0.32 and 0.33).

Events are tagged maps (`{"type": "BlockStored", ...}`), batches are arrays
`[ts, [events], data_parallel_rank]`; fields left at their default are omitted on the wire. Unknown
fields are ignored on decode, so newer vLLM versions still decode; 0.33's `lookahead_token_ids` is
mirrored. Offload tiers are named by (medium, locality, ownership), see `Tier`. Block hashes are
ints by default (low 64 bits of vLLM's digest) or bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

import msgspec

BlockHash = Union[int, bytes]

# Media as vllm/distributed/kv_events.py names them (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE).
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
# Localities as vllm/v1/kv_offload/base.py's Locality enum spells them (relative to the publisher).
LOCALITY_LOCAL, LOCALITY_REMOTE = "LOCAL", "REMOTE"
# Legacy: the medium our disk tier announced before it spoke vLLM's vocabulary (STORAGE, LOCAL,
# ownership = tier id). No router knows it; kept only so old recordings still read and validate.
MEDIUM_DISK = "DISK"


class Tier(NamedTuple):
    """Where an event says blocks are held: vLLM's (medium, locality, ownership). A router keeps one
    index per tier; GPU and CPU tiers leave locality and ownership None."""

    medium: str | None
    locality: str | None = None
    ownership: str | None = None

    @property
    def label(self) -> str:
        """"GPU", "CPU", "STORAGE:LOCAL:<ownership>" ("-" for a missing part before a given one)."""
        parts = [self.medium, self.locality, self.ownership]
        while len(parts) > 1 and parts[-1] is None:
            parts.pop()
        return ":".join("-" if p is None else p for p in parts)


TIER_GPU = Tier(MEDIUM_GPU)
TIER_CPU = Tier(MEDIUM_CPU)

# KV cache spec kinds (`kv_cache_spec_kind`) of groups that keep only some blocks (Mamba state,
# sliding windows): vLLM announces fewer hashes than token blocks, and parents never stored
SPARSE_KINDS = frozenset(
    {"mamba", "sliding_window", "sliding_window_mla", "chunked_local_attention"}
)


def storage_tier(ownership: str, locality: str = LOCALITY_LOCAL) -> Tier:
    """A STORAGE tier named by `ownership` (a tier id stable across restarts)."""
    return Tier(MEDIUM_STORAGE, locality, ownership)


def tier_of(event: "BlockStored | BlockRemoved") -> Tier:
    return Tier(event.medium, event.locality, event.ownership)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def to_jsonable(obj: Any) -> Any:
    """Plain JSON-ready form of a batch or event (tagged with "type"); bytes become hex strings."""
    return _hex_bytes(msgspec.to_builtins(obj, builtin_types=(bytes,)))


def _hex_bytes(x: Any) -> Any:
    if isinstance(x, bytes):
        return x.hex()
    if isinstance(x, list):
        return [_hex_bytes(v) for v in x]
    if isinstance(x, dict):
        return {k: _hex_bytes(v) for k, v in x.items()}
    return x
