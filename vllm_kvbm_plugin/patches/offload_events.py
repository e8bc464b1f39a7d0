"""The tier events of vLLM's OffloadingConnector (CPU, and our STORAGE tiers) as a router needs them.

With `self_describing_kv_events` (KVBMOffloadingSpec turns it on) vLLM's OffloadingEventsTracker
(distributed/kv_transfer/kv_connector/v1/offloading/events.py, 0.32 and 0.33) announces each
offloaded chunk with its hashes, parent and tokens, but:

- with `extra_keys=None` ("Deferred" in vLLM): an image request's tier blocks then look like a
  text request's with the same token ids, though their hashes differ. We fill in the keys vLLM put
  into those hashes, per block, exactly as its GPU events carry them (`_build_event_metadata` for
  whole chunks, `_record_partial_tail` for a hybrid model's partial tail, one key per hash unit);
- in the order of the manager's keys, so a chunk can come before its parent in one batch. We put
  each run of stores in a batch parents first, as GPU events are;
- (0.32) a chunk the tracker has no payload for (a Mamba group's state, a disk tier's restart
  index) as a bare hash without its group's kind, so a router cannot tell a state from an
  attention block. 0.33 gives these placeholders their group's kind; on 0.32 we do the same.

Self-describing events cost the scheduler a payload per stored chunk; vLLM builds it with asserts
and per-hash conversions (an environment lookup each where the engine has not cached them). With
a self-describing tracker we build and announce the very same payloads more directly
(`_build_event_metadata`, `_take_stored_event`): one hash conversion per chunk's list, no re-slicing.

Inert unless the tracker is self-describing (the image keys also need a request with extra keys).
"""

from __future__ import annotations

import msgspec
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
    _OffloadEventMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    OffloadingConnectorScheduler,
)
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashListWithBlockSize,
    resolve_block_hashes,
    to_event_extra_keys,
)
from vllm.v1.kv_offload.base import Medium, OffloadingEvent
from vllm.v1.request import Request

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.patches.wrapping import add_class_default, logger, wrap_method

NAME = "offload_events"
_MEDIUM_NAMES = {Medium.CPU: MEDIUM_CPU, Medium.STORAGE: MEDIUM_STORAGE}
_PRIMARY = (Medium.CPU, None)  # the residency vLLM gives a freshly stored chunk


def apply() -> bool:
    changed = wrap_method(OffloadingEventsTracker, "_build_event_metadata", _wrap_build)
    changed |= add_class_default(OffloadingEventsTracker, "_kvbm_convert", None)
    changed |= wrap_method(OffloadingEventsTracker, "_take_stored_event", _wrap_take_stored)
    changed |= wrap_method(OffloadingEventsTracker, "_record_partial_tail", _wrap_partial_tail)
    changed |= wrap_method(OffloadingEventsTracker, "take_events", _wrap_take_events)
    if not compat.offloading_placeholders_have_kind():
        changed |= add_class_default(OffloadingEventsTracker, "_kvbm_group_specs", None)
        changed |= wrap_method(OffloadingConnectorScheduler, "__init__", _wrap_scheduler_init)
        changed |= wrap_method(OffloadingEventsTracker, "_placeholder_stored", _wrap_placeholder)
    return changed


def _wrap_scheduler_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        tracker = getattr(self, "_events_tracker", None)
        if tracker is not None and tracker.self_describing_enabled:
            tracker._kvbm_group_specs = {g.group_idx: g.kv_event_group_spec for g in self.config.kv_group_configs}
    return __init__


def _wrap_placeholder(orig):
    def _placeholder_stored(self, key, medium, locality, ownership):
        ev = orig(self, key, medium, locality, ownership)
        spec = self._kvbm_group_specs and self._kvbm_group_specs.get(ev.group_idx)
        if not spec:
            return ev
        return msgspec.structs.replace(ev, kv_cache_spec_kind=spec.kv_cache_spec_kind,
                                       kv_cache_spec_sliding_window=spec.kv_cache_spec_sliding_window)
    return _placeholder_stored


def _fill_extra_keys(meta: _OffloadEventMetadata, req: Request, start: int) -> None:
    """Per block of `meta` (tokens from `start` on): the keys vLLM hashed it with."""
    if meta.extra_keys is not None or not compat.has_extra_keys(req):
        return
    bs, keys, mm_idx = meta.block_size, [], 0
    for i in range(len(meta.block_hashes)):
        k, mm_idx = compat.request_extra_keys(req, start + i * bs, start + (i + 1) * bs, mm_idx)
        keys.append(k)
    if any(k is not None for k in keys):
        meta.extra_keys = tuple(keys)


def _wrap_build(orig):
    def _build_event_metadata(self, req, group_config, chunk_idx):
        # called by record_store/record_lookup of a self-describing tracker, for whole chunks of
        # full-attention groups only (they filter the rest out)
        return _chunk_metadata(req, group_config, chunk_idx)
    return _build_event_metadata


def _wrap_partial_tail(orig):
    def _record_partial_tail(self, req, group_config, boundary_tokens, offload_key):
        orig(self, req, group_config, boundary_tokens, offload_key)
        meta = self._pending_event_metadata.get(offload_key)
        if meta is not None:
            _fill_extra_keys(meta, req, boundary_tokens - len(meta.token_ids))
    return _record_partial_tail


def _chunk_metadata(req: Request, g: GroupOffloadConfig, chunk_idx: int) -> _OffloadEventMetadata:
    """vLLM's `_build_event_metadata` payload of one whole chunk (its hashes at block size, the
    hash before it as parent, its tokens), built without its checks, with our image keys."""
    per_chunk, tokens = g.hashes_per_chunk, g.tokens_per_chunk
    first = chunk_idx * per_chunk
    hashes = req.block_hashes
    chunk_hashes: list[BlockHash] | BlockHashListWithBlockSize = hashes[first: first + per_chunk]
    per_hash = tokens // per_chunk
    if per_hash != g.tokens_per_block:
        chunk_hashes = resolve_block_hashes(chunk_hashes, per_hash, g.tokens_per_block)
    start = chunk_idx * tokens
    lora = req.lora_request
    meta = _OffloadEventMetadata(
        block_hashes=tuple(chunk_hashes), parent_block_hash=hashes[first - 1] if first else None,
        token_ids=tuple(req.all_token_ids[start: start + tokens]), block_size=g.tokens_per_block,
        lora_id=lora.adapter_id if lora is not None else None, lora_name=lora.name if lora is not None else None,
        extra_keys=None, group_idx=g.group_idx, kv_cache_spec=g.kv_event_group_spec,
        active_residencies={_PRIMARY})
    if compat.has_extra_keys(req):
        _fill_extra_keys(meta, req, start)
    return meta


_warned_no_payload = False


def _wrap_take_stored(orig):
    def _take_stored_event(self, event):
        if not self.self_describing_enabled:
            return orig(self, event)
        return _self_describing_stored(self, event)
    return _take_stored_event


def _self_describing_stored(tracker: OffloadingEventsTracker, event: OffloadingEvent) -> list[BlockStored]:
    """vLLM's BlockStored of each key of a store event, its hashes converted a list at a time."""
    global _warned_no_payload
    convert = tracker._kvbm_convert  # type: ignore[attr-defined]  # ours: add_class_default
    if convert is None:
        convert = tracker._kvbm_convert = compat.event_hash_converter()  # type: ignore[attr-defined]
    pending = tracker._pending_event_metadata
    locality = event.locality.value if event.locality is not None else None
    medium, ownership = event.medium, event.ownership
    medium_name = _MEDIUM_NAMES[medium]
    out = []
    for key in event.keys:
        meta = pending.get(key)
        if meta is None:
            if not _warned_no_payload:
                _warned_no_payload = True
                logger.warning("OffloadingEventsTracker: no payload for a stored chunk (a state group's, or a "
                               "tier hit not seen by the primary tier): announced as a bare hash")
            out.append(tracker._placeholder_stored(key, medium, locality, ownership))
            continue
        if event.removal_expected:
            meta.active_residencies.add((medium, ownership))
        parent = meta.parent_block_hash
        spec = meta.kv_cache_spec
        out.append(BlockStored(
            block_hashes=convert(meta.block_hashes),
            parent_block_hash=convert((parent,))[0] if parent is not None else None,
            token_ids=list(meta.token_ids), block_size=meta.block_size, lora_id=meta.lora_id,
            medium=medium_name, lora_name=meta.lora_name,
            extra_keys=to_event_extra_keys(meta.extra_keys) if meta.extra_keys else None,
            group_idx=meta.group_idx, kv_cache_spec_kind=spec.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=spec.kv_cache_spec_sliding_window,
            locality=locality, ownership=ownership))
    return out


def _wrap_take_events(orig):
    def take_events(self, events):
        if not self.self_describing_enabled:  # placeholders name no parent: nothing to reorder
            return orig(self, events)
        out, run = [], []
        for ev in orig(self, events):
            if isinstance(ev, BlockStored):
                run.append(ev)
                continue
            out += parents_first(run)
            run = []
            out.append(ev)
        out += parents_first(run)
        return out
    return take_events


def parents_first(stored: list[BlockStored]) -> list[BlockStored]:
    """`stored` reordered so that an event whose parent another of them stores (same medium,
    ownership and group) comes after that one; otherwise in the given order."""
    if len(stored) < 2:
        return stored
    by_last: dict[tuple[str | None, str | None, int | None, object], int] = {}
    for i, ev in enumerate(stored):
        if ev.block_hashes:
            by_last[(ev.medium, ev.ownership, ev.group_idx, ev.block_hashes[-1])] = i
    if all(by_last.get((ev.medium, ev.ownership, ev.group_idx, ev.parent_block_hash), -1) < i
           for i, ev in enumerate(stored)):
        return stored  # already parents first (a request's chunks come in order): what emit() gives
    out: list[BlockStored] = []
    done = [False] * len(stored)

    def emit(i: int | None) -> None:
        chain = []
        while i is not None and not done[i]:
            done[i] = True  # marked before its parent: a cycle cannot loop
            chain.append(i)
            ev = stored[i]
            i = by_last.get((ev.medium, ev.ownership, ev.group_idx, ev.parent_block_hash))
        out.extend(stored[j] for j in reversed(chain))

    for i in range(len(stored)):
        emit(i)
    return out
