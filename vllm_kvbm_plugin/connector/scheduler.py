"""KVBMConnector, scheduler side (EngineCore): the tier indexes, load and store decisions, events.

Per step:
- `get_num_new_matched_tokens`: count the request's next blocks that the CPU tier holds; blocks
  only on disk are first prefetched into CPU slots (the worker verifies them) and the request
  waits a step (`None`), so a load into the KV cache only ever copies verified CPU bytes.
- `update_state_after_alloc`: turn the claim into (block id, slot) loads; the slots stay pinned
  until the metadata is built (the worker loads before anything reuses them).
- `build_connector_meta`: store every newly completed block of the scheduled requests into CPU
  slots (and write them through to disk), evicting by the configured policy.
- `update_connector_output`: mark what the workers finished; announce and remove tier blocks.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import msgspec

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import to_event_extra_keys

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.metadata import KVBMMetadata, KVBMWorkerMetadata
from vllm_kvbm_plugin.connector.layout import key_root, rank_dir
from vllm_kvbm_plugin.events.types import MEDIUM_CPU, MEDIUM_DISK
from vllm_kvbm_plugin.hashing import extra_hash, request_keys
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import disk as diskfmt
from vllm_kvbm_plugin.tiers.index import TierIndex
from vllm_kvbm_plugin.tiers.policies import make_policy

logger = get_logger("connector")


_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE_STORED = msgspec.msgpack.Decoder(BlockStored).decode


def _file_info(meta: bytes | None):
    """(block position, BlockStored) from a block file's metadata, or None."""
    try:
        info = msgspec.msgpack.decode(meta) if meta else None
        if not info or not info.get("event"):
            return None
        return int(info["block"]), _DECODE_STORED(info["event"])
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError):
        return None


@dataclasses.dataclass
class _Announce:
    event: object | None  # BlockStored to publish once the bytes are in place (None: unknown)
    vhash: object = None  # vLLM's event hash of the block, for BlockRemoved
    announced: bool = False


@dataclasses.dataclass
class _Request:
    request: object
    unit_keys: list  # stable keys of the hash units computed so far
    stored_upto: int = 0  # blocks [0, stored_upto) were offered to the tiers


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: KVBMConfig):
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                "KVBMConnector: models with several KV cache groups (hybrid Mamba or sliding-window "
                "attention) are not supported by the tiers yet; run without the connector"
            )
        spec = groups[0].kv_cache_spec
        self.cfg = cfg
        self.block_size = spec.block_size
        self.hash_unit = kv_cache_config.hash_block_size or self.block_size
        self.units_per_block = self.block_size // self.hash_unit
        self.block_bytes = spec.page_size_bytes * len(groups[0].layer_names)
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

        self.kind = get_kv_cache_spec_kind(spec).value  # tier events say what they hold
        self.world = vllm_config.parallel_config.world_size
        self.root = key_root(vllm_config, kv_cache_config, self.hash_unit)
        self.cpu = TierIndex(cfg.cpu_bytes_to_use // self.block_bytes, make_policy(cfg.eviction_policy))
        self.disk: TierIndex | None = None
        self.disk_writes_on = False
        if cfg.disk_path:
            self.disk = TierIndex(cfg.disk_bytes_to_use // self.block_bytes, make_policy(cfg.eviction_policy))
            self.disk_bases = [rank_dir(cfg.disk_path, self.root, r) for r in range(self.world)]
            self.disk_writes_on = True
        self.requests: dict[str, _Request] = {}
        self.claims: dict[str, tuple[int, list]] = {}
        self.prefetching: set = set()  # keys being read from disk into CPU slots
        self.meta = KVBMMetadata()
        self.loads_pinned: list = []
        self.parent_pins: dict = {}  # (medium, key) -> parent pinned until the key settles
        self.reports: Counter = Counter()
        self.events: list = []
        self.to_event_hashes = compat.event_hash_converter()
        self.pool = None  # vLLM's BlockPool, bound later (extra keys like vLLM computes them)
        self.kv_cache_manager = None  # bound later (block ids of the requests)
        if self.disk is not None:
            self._load_disk_index()
        logger.info(
            "KVBMConnector: CPU tier %d blocks of %d bytes (%.1f MiB), disk tier %s, eviction %s",
            self.cpu.capacity, self.block_bytes, self.cpu.capacity * self.block_bytes / 2**20,
            f"{self.disk.capacity} blocks under {cfg.disk_path}" if self.disk is not None else "off",
            cfg.eviction_policy,
        )

    # ---- keys and events -------------------------------------------------------------------
    def _state(self, request) -> _Request:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = _Request(request, [])
        return st

    def _block_keys(self, st: _Request, n_blocks: int) -> list:
        """Stable keys of the first n_blocks blocks (the key of each block's last unit)."""
        r, unit = self.units_per_block, self.hash_unit
        have, need = len(st.unit_keys), n_blocks * r
        if need > have:
            req = st.request
            tokens = req.all_token_ids[have * unit : need * unit]
            extras = None
            if compat.has_extra_keys(req):
                extras, mm = {}, 0
                for u in range(have, need):
                    keys, mm = compat.block_extra_keys(self.pool, req, u * unit, (u + 1) * unit, mm)
                    if keys:
                        extras[u - have] = extra_hash(keys)
            parent = st.unit_keys[-1] if have else self.root
            new = request_keys(tokens, unit, parent, extras)
            st.unit_keys += [(int(a), int(b)) for a, b in new.tolist()]
        return st.unit_keys[r - 1 : need : r]

    def _announcement(self, request, i: int, medium: str) -> _Announce:
        conv = self.to_event_hashes
        r, B = self.units_per_block, self.block_size
        hashes = request.block_hashes
        if len(hashes) < (i + 1) * r:
            return _Announce(None)
        vhash = conv([hashes[(i + 1) * r - 1]])[0]
        parent = conv([hashes[i * r - 1]])[0] if i else None
        extra = None
        if compat.has_extra_keys(request):
            extra = to_event_extra_keys([compat.block_extra_keys(self.pool, request, i * B, (i + 1) * B, 0)[0]])
        event = compat.block_stored_event(
            self.pool, request, block_hashes=[vhash], parent_block_hash=parent,
            token_ids=request.all_token_ids[i * B : (i + 1) * B], block_size=B, group_idx=0,
            extra_keys=extra or [None], medium=medium)
        event.kv_cache_spec_kind = self.kind
        return _Announce(event, vhash)

    def _reserve(self, tier: TierIndex, medium: str, request, i: int, key, parent):
        """Reserve `key` in `tier`; its parent stays pinned until the key is settled, so a
        BlockRemoved of the parent can never precede the child's BlockStored."""
        if parent is not None:
            tier.pin(parent)
        entry, evicted = tier.reserve(key, parent, self._announcement(request, i, medium))
        self._gone(evicted, medium)
        if entry is None:
            if parent is not None:
                tier.unpin(parent)
        elif parent is not None:
            self.parent_pins[(medium, key)] = parent
        return entry

    def _settle(self, tier: TierIndex, medium: str, key, ok: bool) -> None:
        """The bytes of `key` landed (ok) or not: announce or drop it, release its parent."""
        parent = self.parent_pins.pop((medium, key), None)
        if parent is not None:
            tier.unpin(parent)
        if ok:
            e = tier.complete(key)
            if e is not None:
                self._announce_stored(e)
        else:
            tier.remove(key)

    def _announce_stored(self, entry) -> None:
        a = entry.meta
        if a is not None and a.event is not None and not a.announced:
            self.events.append(a.event)
            a.announced = True

    def _gone(self, evicted, medium: str) -> None:
        """Entries that left a tier: announce the removals, delete disk files."""
        hashes = [e.meta.vhash for _, e in evicted if e is not None and e.meta is not None and e.meta.announced]
        if hashes:
            self.events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0))
        if medium == MEDIUM_DISK:
            for key, _ in evicted:
                self._unlink(key)

    def _load_disk_index(self) -> None:
        """Index the block files of earlier runs and announce them (parents first) from the
        BlockStored each file carries in its metadata."""
        found = diskfmt.scan(self.disk_bases[0])
        described = []
        for key, _size in found:
            e, evicted = self.disk.reserve(key)
            self._gone(evicted, MEDIUM_DISK)  # more files than disk_bytes_to_use allows
            if e is None:
                continue
            self.disk.complete(key)
            info = _file_info(diskfmt.read_meta(diskfmt.block_path(self.disk_bases[0], key)))
            if info is not None:
                e.meta = _Announce(info[1], info[1].block_hashes[0])
                described.append((info[0], key, e))
        held = set()
        for _, _, e in sorted(described, key=lambda d: d[0]):
            if e.meta.event.parent_block_hash is None or e.meta.event.parent_block_hash in held:
                self._announce_stored(e)
                held.add(e.meta.vhash)
        if found:
            logger.info("KVBMConnector: disk tier holds %d blocks from earlier runs (%d announced)",
                        len(self.disk), len(held))

    def _unlink(self, key) -> None:
        for base in self.disk_bases:
            try:
                os.unlink(diskfmt.block_path(base, key))
            except OSError:
                pass

    # ---- vLLM hooks ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        B = self.block_size
        start = num_computed_tokens // B
        limit = (request.num_tokens - 1) // B  # vLLM must compute at least one token
        if limit <= start:
            return 0, False
        st = self._state(request)
        keys = self._block_keys(st, limit)
        hits, on_disk_only = 0, []
        for i in range(start, limit):
            k = keys[i]
            if k in self.prefetching:
                return None, False  # its verification is still running
            if not on_disk_only and self.cpu.ready(k):
                hits += 1
            elif self.disk is not None and self.disk.ready(k) and k not in self.cpu:
                on_disk_only.append((i, k))
            else:
                break
        if on_disk_only:
            hit_keys = keys[start : start + hits]
            for k in hit_keys:  # prefetching must not evict the blocks it extends
                self.cpu.pin(k)
            issued = self._prefetch(request, keys, on_disk_only)
            for k in hit_keys:
                self.cpu.unpin(k)
            if issued:
                return None, False  # come back once the disk blocks are verified in CPU slots
        self._release_claim(request.request_id)
        if hits:
            claimed = keys[start : start + hits]
            for k in claimed:  # nothing may evict a claimed block before its load has run
                self.cpu.pin(k)
            self.claims[request.request_id] = (start, claimed)
        return hits * B, False

    def _release_claim(self, req_id: str) -> None:
        for k in self.claims.pop(req_id, (0, []))[1]:
            self.cpu.unpin(k)

    def _prefetch(self, request, keys, blocks) -> bool:
        issued = False
        for i, k in blocks:
            entry = self._reserve(self.cpu, MEDIUM_CPU, request, i, k, keys[i - 1] if i else None)
            if entry is None:
                break
            self.disk.pin(k)
            self.prefetching.add(k)
            self.meta.prefetches.append((k, entry.slot))
            issued = True
        return issued

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        claim = self.claims.pop(request.request_id, None)
        if claim is None:
            return
        start, keys = claim
        n = max(num_external_tokens, 0) // self.block_size
        block_ids = blocks.get_block_ids()[0]
        for i, k in enumerate(keys):
            if i >= n:
                self.cpu.unpin(k)
                continue
            self.cpu.touch(k)
            self.loads_pinned.append(k)  # unpinned once the metadata is built
            self.meta.loads.append((block_ids[start + i], self.cpu.entries[k].slot))

    def build_connector_meta(self, scheduler_output) -> KVBMMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            self._store(new.req_id, new.num_computed_tokens
                        + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._store(req_id, cached.num_computed_tokens[i]
                        + scheduler_output.num_scheduled_tokens[req_id])
        for k in self.loads_pinned:
            self.cpu.unpin(k)
        self.loads_pinned = []
        for req_id in list(self.claims):  # claimed, but vLLM could not allocate: no load
            self._release_claim(req_id)
        meta, self.meta = self.meta, KVBMMetadata()
        return meta

    def _store(self, req_id: str, computed_after_step: int) -> None:
        st = self.requests.get(req_id)
        if st is None:
            return
        req = st.request
        n_full = computed_after_step // self.block_size
        if self.cfg.offload_prompt_only:
            n_full = min(n_full, req.num_prompt_tokens // self.block_size)
        if n_full <= st.stored_upto:
            return
        keys = self._block_keys(st, n_full)
        block_ids = None
        i = st.stored_upto
        while i < n_full:
            k, parent = keys[i], keys[i - 1] if i else None
            if parent is not None and parent not in self.cpu:
                break  # a tier holds whole prefixes: no block without its parent
            entry = self.cpu.entries.get(k)
            if entry is None:
                entry = self._reserve(self.cpu, MEDIUM_CPU, req, i, k, parent)
                if entry is None:
                    break
                if block_ids is None:
                    block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
                self.meta.stores.append((k, block_ids[i], entry.slot))
            else:
                self.cpu.touch(k)
            self._write_through(req, i, k, parent, entry)
            i += 1
        st.stored_upto = i

    def _write_through(self, req, i: int, k, parent, cpu_entry) -> None:
        if not self.disk_writes_on or k in self.disk or (parent is not None and parent not in self.disk):
            return
        if self._reserve(self.disk, MEDIUM_DISK, req, i, k, parent) is None:
            return
        self.cpu.pin(k)  # the slot is the source of the write
        # the block's position and its DISK BlockStored: announced again after a restart
        event = self.disk.entries[k].meta.event
        blob = _ENCODE({"block": i, "event": _ENCODE(event) if event else None})
        self.meta.disk_writes.append((k, cpu_entry.slot, blob))

    def update_connector_output(self, output) -> None:
        wm: KVBMWorkerMetadata | None = getattr(output, "kv_connector_worker_meta", None)
        if not wm:
            return
        for k in self._done("stored", wm.stored):
            self._settle(self.cpu, MEDIUM_CPU, k, True)
        for k in self._done("prefetched", wm.prefetched):
            self.prefetching.discard(k)
            self.disk.unpin(k)
            self._settle(self.cpu, MEDIUM_CPU, k, True)
        for k in dict.fromkeys(wm.prefetch_failed):
            self.prefetching.discard(k)
            self._settle(self.cpu, MEDIUM_CPU, k, False)
            logger.warning("KVBMConnector: disk block %s is corrupt or missing; dropped (a miss)",
                           diskfmt.key_hex(k))
            self._gone([(k, self.disk.remove(k))], MEDIUM_DISK)
        for k in self._done("written", wm.disk_written):
            self.cpu.unpin(k)  # the write's source slot
            self._settle(self.disk, MEDIUM_DISK, k, True)
        failed = list(dict.fromkeys(wm.disk_failed))
        for k in failed:
            self.cpu.unpin(k)
            self._settle(self.disk, MEDIUM_DISK, k, False)
        if failed and self.disk_writes_on:
            self.disk_writes_on = False
            logger.warning("KVBMConnector: disk writes failed (%d blocks); the disk tier stops "
                           "storing and keeps serving what it holds", len(failed))

    def _done(self, kind: str, keys: list) -> list:
        """Keys every worker has reported for `kind` (one report per worker)."""
        out = []
        for k in keys:
            self.reports[(kind, k)] += 1
            if self.reports[(kind, k)] >= self.world:
                del self.reports[(kind, k)]
                out.append(k)
        return out

    def request_finished(self, request) -> None:
        self.requests.pop(request.request_id, None)
        self._release_claim(request.request_id)

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events
