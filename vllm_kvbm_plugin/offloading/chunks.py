"""What our vLLM secondary tiers (KVBMDiskTier, KVBMRemoteTier) share: how a primary-tier chunk is
named and described in our block format, and the scaffolding around vLLM's SecondaryTierManager.

vLLM names a chunk by its OffloadKey (block hash + group, 36 bytes with sha256); the disk format
names blocks by a 128-bit key, so the file key is a 128-bit digest of the OffloadKey and the
OffloadKey itself (with its parent and end position, for a restart index) is in the block's
metadata (`ChunkMeta`, covered by the block's MAC), compared on every load.

Both tiers run in the EngineCore process, which does all their I/O, so each holds the tier secret
the way KVBMConnector does (tiers/secret.py tier_secret: KVBM_KEY_SECRET, else the disk tier's
`<path>/kvbm-key-secret`, the remote tier's store entry): its MAC key (tiers/mac.py), and a layout
fingerprint keyed by it, so instances with different secrets never read (nor delete) each other's
blocks.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np
from vllm.v1.kv_offload.base import Medium, OffloadingEvent, OffloadingSpec, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from vllm_kvbm_plugin.tiers.mac import mac_key

_FORMAT = "vllm-offload-chunk-v1"  # part of the fingerprint: how a chunk's bytes are laid out


class ChunkMeta(msgspec.Struct, array_like=True):
    """A block's metadata: which chunk it holds, for the load check and the restart index."""
    key: bytes
    parent: bytes | None
    end: int


encode_meta = msgspec.msgpack.Encoder().encode
decode_meta = msgspec.msgpack.Decoder(ChunkMeta).decode


def file_key(key: bytes) -> tuple[int, int]:
    """The 128-bit disk-format key of an OffloadKey."""
    d = hashlib.blake2b(key, digest_size=16).digest()
    return int.from_bytes(d[:8], "big"), int.from_bytes(d[8:], "big")


def layout_fingerprint(spec: OffloadingSpec, chunk_bytes: int, secret: bytes) -> bytes:
    """16 bytes naming everything that makes a chunk's bytes mean what they mean: model, dtype,
    groups, chunk geometry, parallelism, KV layout, keyed by the tier secret. Stable across
    restarts of the same setup."""
    c = spec.config
    par = c.parallel
    parts = (
        _FORMAT, c.model.name, str(c.model.dtype),
        tuple((g.tokens_per_block, g.group_id, tuple(g.layer_names)) for g in c.groups),
        c.worker_kv_bytes_per_block, c.cache.tokens_per_hash, c.cache.blocks_per_chunk, chunk_bytes,
        par.world_size, par.tp_size, par.pp_size, par.pcp_size, par.dcp_size,
        getattr(c, "replicated_layout", False), getattr(c, "canonical_layout", False),
        getattr(c, "kv_cache_layout", None),
    )
    return hashlib.blake2b(repr(parts).encode(), digest_size=16, key=secret).digest()


class ChunkTier(SecondaryTierManager):
    """The base of KVBMDiskTier and KVBMRemoteTier (built by vLLM's tiering manager in the
    EngineCore process, called on its scheduler thread): the primary tier's chunks as byte rows
    (`_rows`), the layout fingerprint and the tier's ownership ("<kind>:<fingerprint>"), the jobs
    in flight (job id -> (futures, is_load, work)) and the events, if the engine publishes them;
    `secret` is the tier secret (module docstring)."""

    medium = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str, kind: str,
                 enable_kv_events: bool, secret: bytes,
                 backpressure_detector: BackpressureDetector | None = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.chunk_bytes = self.block_size_bytes
        rows = np.asarray(primary_kv_view)
        self._rows = rows.view(np.uint8).reshape(rows.shape[0], -1)[:, : self.chunk_bytes]
        self.fingerprint = layout_fingerprint(offloading_spec, self.chunk_bytes, secret)
        self.mac_key = mac_key(secret)
        self.ownership = f"{kind}:{self.fingerprint.hex()}"
        events_on = bool(enable_kv_events) and offloading_spec.kv_events_config.enable_kv_cache_events
        self._events: list[OffloadingEvent] | None = [] if events_on else None
        # job id -> (futures, is a load, the work as the tier's completion reads it)
        self._jobs: dict[int, tuple[list[concurrent.futures.Future[Any]], bool, Any]] = {}

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        concurrent.futures.wait([f for fs, _, _ in self._jobs.values() for f in fs])

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def _finished(self) -> list:
        """The jobs whose futures are all done, taken out: (job id, futures, is_load, work). Stores
        finish in the order they were submitted: a chunk is announced after its parent, which an
        earlier store job may still be writing (the validator's unknown_parent otherwise)."""
        done, store_pending = [], False
        for j, (fs, is_load, _) in self._jobs.items():
            ready = all(f.done() for f in fs)
            if not is_load:
                store_pending = store_pending or not ready
                ready = not store_pending
            if ready:
                done.append(j)
        return [(j, *self._jobs.pop(j)) for j in done]

    def _event(self, keys: list, removed: bool) -> None:
        if keys and self._events is not None:
            self._events.append(OffloadingEvent(keys=keys, medium=Medium.STORAGE, removed=removed,
                                                locality=self.locality, ownership=self.ownership,
                                                removal_expected=True))
