"""A router-side KV index: how many tokens of a prompt each worker will serve from its caches.

Fed decoded `KVEventBatch`es from any number of workers (an instance's publisher, one worker per
data-parallel rank), all KV cache groups and tiers (GPU, CPU, STORAGE local or remote).
`KVIndex.match(token_ids)` answers, per worker, what vLLM will report as `num_cached_tokens`:

- Attention-only models: the longest chain of announced blocks, capped at n - 1 tokens (vLLM
  always recomputes the last prompt token).
- Hybrid models (Mamba / linear attention + attention): the largest X <= n - 1 on a hash-unit
  boundary with every attention unit of [0, X) held and a state checkpoint at X held by every Mamba
  group. Checkpoints come from vLLM's Mamba-group events; their hash is the attention unit's hash
  at the same position, so no token ids are needed to place them (vLLM's Mamba events are
  irregular: some carry no hash, some one hash for several blocks).
- Offload tiers (KVBMConnector's CPU and disk): after the GPU hit, the connector's own rule: the
  longest run of tier blocks from the GPU hit's block, and for hybrid models the largest X with a
  tier state at X (see connector/scheduler.py `_plan`). vLLM's OffloadingConnector with our spec
  (`WorkerConfig.connector`) follows the same rule, except that a state inside a block (a hybrid's
  partial tail) counts from the CPU tier only: vLLM asks the tiers for it only once the whole
  blocks are in the CPU tier, and does not wait for a secondary tier to promote it
  (docs/offloading.md, "partial tail").
- A shared REMOTE tier (STORAGE, locality REMOTE, one ownership per store: our Redis tiers) is one
  index for the whole fleet, as the store is one: a block that instance A (or the remote tier's
  announcer stream) announced there is a hit for instance B, and a removal from any stream
  removes it. Which workers read which shared tiers: `WorkerConfig.remote`. An instance's restart
  (its stream from seq 0 again) forgets its own tiers, not the store's.

The prompt's hashes are computed as vLLM computes them (events/prompt_hashes.py, `PromptHasher`).
Where they cannot be computed (xxhash with vLLM's random per-process seed, or without the
package), the index learns `(parent, tokens, extra keys) -> hash` from the stream's token ids and
walks the prompt through it.

Exact bookkeeping: a hash is held by a (worker, tier, group) while its store count is positive
(the plugin's coarse and unit events announce one hash at two block sizes), kept in numba tables
with no Python object per hash (events/held_table.py; the serving rules: events/hit_rules.py), `AllBlocksCleared`
empties the worker's GPU tier, and a batch lost in transit (a sequence gap) marks the instance
stale: later batches wait until the missing ones are applied (the subscriber's replay) or the
instance is reset.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from vllm_kvbm_plugin.events.held_table import REMOVE, STORE, HeldTable, hash_keys
from vllm_kvbm_plugin.events.hit_rules import gpu_hit_units, tier_hit
from vllm_kvbm_plugin.events.index_workers import (IGNORED_KINDS, STATE_KINDS, TIER_GPU, Holder, PendingOps,
                                                   ServeBits, Worker, WorkerConfig, WorkerMatch, event_tier,
                                                   frozen_keys, merge_keys)
from vllm_kvbm_plugin.events.prompt_hashes import event_extra_keys
from vllm_kvbm_plugin.events.types import (
    BlockHash,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Tier,
)
from vllm_kvbm_plugin.log import get_logger

__all__ = ["TIER_GPU", "KVIndex", "WorkerConfig", "WorkerMatch"]

logger = get_logger("index")

_MAX_PENDING = 10_000  # batches kept per stale instance while waiting for the missing ones
_FLUSH_AT = 1 << 16  # buffered hashes applied to the table in one kernel call


class KVIndex:
    """A router's view of what every worker of a fleet holds (module docstring): owns, per worker,
    its config, hasher and held hashes per tier and group, and per instance the event sequence
    (gaps, stale batches). Fed by the router's subscribers (`apply`), asked by its request
    handler (`match`); runs in the router's process (router.py, `vllm-kvbm route`), or
    embedded in another router. Workers are named `(instance, data-parallel rank)`."""

    def __init__(self, default: WorkerConfig | None = None) -> None:
        self.default = default or WorkerConfig()
        self.configs: dict[Any, WorkerConfig] = {}  # instance -> config
        self.workers: dict[tuple, Worker] = {}
        # hash -> bits of the (worker, tier, group)s holding it, and store counts; attention and
        # state holders have bits of their own, so one lookup per unit serves both
        self.table = HeldTable()
        # shared REMOTE tiers: (tier, group) -> holder, one for every stream (module docstring);
        # shared_gen changes whenever one is added or learns its kind (workers' tier bits then)
        self.shared: dict[tuple, Holder] = {}
        self.shared_gen = 0
        self.as_int: bool | None = None  # the hash form of the first hash any stream announced
        # worker -> the shared tiers it announced into: it still reads them after a restart
        self.remote_reads: dict[tuple, set] = {}
        self._next_holder = 0
        # per instance: next expected seq, missing seqs, batches waiting behind a gap
        self.next_seq: dict[Any, int] = {}
        self.missing: dict[Any, set] = {}
        self.pending: dict[Any, dict[int, KVEventBatch]] = {}
        self._stats = {"batches": 0, "stored": 0, "removed": 0, "unknown_removals": 0, "gaps": 0}
        # stores and removals not applied to the table yet: applied in one kernel call per
        # _FLUSH_AT hashes, and before anything reads the table (_flush)
        self._ops = PendingOps()
        self._unknown = 0  # removals from holders never announced (the table counts the others)

    @property
    def stats(self) -> dict:
        """Batches, hashes stored and removed, removals of hashes not held, sequence gaps."""
        self._flush()
        return self._stats

    def _flush(self) -> None:
        self._ops.flush(self.table, self._stats)
        self._stats["unknown_removals"] = self._unknown + self.table.unknown_removals

    # ---- configuration ----
    def add_instance(self, instance: Hashable, config: WorkerConfig | None = None, ranks: Iterable[int] = ()) -> None:
        """`instance`'s config; with `ranks` (data-parallel ranks), its workers are matched from
        now on, before their first event (a new instance may serve a shared remote tier's blocks)."""
        self.configs[instance] = config or self.default
        for dp in ranks:
            self._worker(instance, dp)

    def _worker(self, instance: Hashable, dp: int | None) -> Worker:
        key = (instance, dp)
        w = self.workers.get(key)
        if w is None:
            w = self.workers[key] = Worker(key, self.configs.get(instance, self.default),
                                            self.remote_reads.setdefault(key, set()))
        return w

    # ---- events ----
    def apply(self, instance: Hashable, batch: KVEventBatch, seq: int | None = None) -> None:
        """Apply one batch of `instance`'s stream. With `seq`, a gap marks the instance stale and
        holds later batches until the missing ones arrive (or `reset`)."""
        if seq is None:
            self._apply(instance, batch)
            return
        expected = self.next_seq.get(instance)
        missing = self.missing.get(instance)
        if missing and seq in missing:  # a recovered batch
            missing.discard(seq)
            self.pending.setdefault(instance, {})[seq] = batch
            self._drain(instance)
            return
        if expected is not None and seq < expected:
            if seq == 0:  # the publisher restarted: its engine lost everything it announced
                logger.warning("KV index: instance %s restarted its event stream; resetting it", instance)
                self.reset(instance)
            else:
                return  # a duplicate
        if expected is not None and seq > expected:
            self._stats["gaps"] += 1
            self.missing.setdefault(instance, set()).update(range(expected, seq))
            logger.warning("KV index: instance %s lost batches %d..%d: stale until they are replayed",
                           instance, expected, seq - 1)
        self.next_seq[instance] = seq + 1
        if self.missing.get(instance):
            pending = self.pending.setdefault(instance, {})
            pending[seq] = batch
            if len(pending) > _MAX_PENDING:
                logger.warning("KV index: instance %s: too many batches behind a gap; dropping them", instance)
                pending.clear()
            return
        self._apply(instance, batch)

    def _drain(self, instance: Hashable) -> None:
        missing, pending = self.missing.get(instance, set()), self.pending.get(instance, {})
        for s in sorted(pending):
            if any(m < s for m in missing):
                break
            self._apply(instance, pending.pop(s))

    def is_stale(self, instance: Hashable) -> bool:
        return bool(self.missing.get(instance))

    def reset(self, instance: Hashable) -> None:
        """Forget everything `instance` announced (it restarted, or a gap will never be recovered)."""
        self._flush()
        for key in [k for k in self.workers if k[0] == instance]:
            w = self.workers.pop(key)
            for holder in w.holders.values():
                self.table.clear(holder.id)
            if instance in self.configs:  # a configured instance stays matched (add_instance)
                self._worker(*key)
        self.next_seq.pop(instance, None)
        self.missing.pop(instance, None)
        self.pending.pop(instance, None)

    def _apply(self, instance: Hashable, batch: KVEventBatch) -> None:
        self._stats["batches"] += 1
        w = self._worker(instance, batch.data_parallel_rank)
        ops = self._ops
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(w, ev, ops)
            elif isinstance(ev, BlockRemoved):
                self._removed(w, ev, ops)
            elif isinstance(ev, AllBlocksCleared):
                self._flush()
                if w.remote_tiers and not w.holders:  # the remote tier's announcer: the store was flushed
                    for (tier, _), holder in self.shared.items():
                        if tier in w.remote_tiers:
                            self.table.clear(holder.id)
                for (tier, _), holder in w.holders.items():
                    if tier == TIER_GPU:
                        self.table.clear(holder.id)
        if len(ops) >= _FLUSH_AT:
            self._flush()

    def _new_holder(self, kind: str | None) -> Holder:
        holder = Holder(self._next_holder, kind)
        self._next_holder += 1
        self.table.add_holder(holder.id)
        return holder

    def _holder(self, w: Worker, tier: Tier, group: int | None, kind: str | None) -> Holder:
        if tier.locality == LOCALITY_REMOTE:
            return self._shared_holder(w, tier, group, kind)
        holder = w.holders.get((tier, group))
        if holder is None:
            holder = w.holders[(tier, group)] = self._new_holder(kind)
            w.holder_ids.append(holder.id)
            w._serve_bits = None
            if kind in STATE_KINDS:
                w.hybrid = True
        elif holder.kind is None and kind is not None:
            holder.kind = kind
            w._serve_bits = None
            w.hybrid = w.hybrid or kind in STATE_KINDS
        return holder

    def _shared_holder(self, w: Worker, tier: Tier, group: int | None, kind: str | None) -> Holder:
        """The fleet's holder of a shared REMOTE tier's group; `w` announced into it."""
        if tier not in w.remote_tiers:
            w.remote_tiers.add(tier)
            w._serve_bits = None
        holder = self.shared.get((tier, group))
        if holder is None:
            holder = self.shared[(tier, group)] = self._new_holder(kind)
            self.shared_gen += 1
        elif holder.kind is None and kind is not None:
            holder.kind = kind
            self.shared_gen += 1
        return holder

    def _serve_bits(self, w: Worker) -> ServeBits:
        """What `w` serves from, as holder bits: its own tiers and the shared REMOTE tiers it
        reads (`WorkerConfig.remote`)."""
        words = self.table.words
        cached = w._serve_bits
        if cached is not None and cached[0] == self.shared_gen and cached[1] == words:
            return cached[2]
        ids: dict[Tier, tuple[list, list]] = {}
        reads = w.config.remote
        shared = [(k, h) for k, h in self.shared.items()
                  if reads == "all" or (reads == "announced" and k[0] in w.remote_tiers)]
        for (tier, _), holder in itertools.chain(w.holders.items(), shared):
            kv, st = ids.setdefault(tier, ([], []))
            (st if holder.kind in STATE_KINDS else kv).append(holder.id)
        bits = {t: np.stack([self.table.bits(kv), self.table.bits(st)]) for t, (kv, st) in ids.items()}
        others = tuple(t for t in bits if t != TIER_GPU)
        native = w.config.connector == "OffloadingConnector"
        mid_tiers = [t for t in others if not native or t.medium == MEDIUM_CPU]
        empty = np.zeros((0, 2, words), np.uint64)
        gpu = ids.get(TIER_GPU)
        sb = ServeBits(
            hybrid=w.hybrid or any(st for _, st in ids.values()),
            gpu_kv=bits[TIER_GPU][0] if gpu and gpu[0] else None,
            gpu_st=bits[TIER_GPU][1] if gpu else np.zeros(words, np.uint64),
            others=others,
            single={t: bits[t][None] for t in others},
            mid={t: bits[t][None] if t in mid_tiers else empty for t in others},
            all_tiers=np.stack([bits[t] for t in others]) if others else empty,
            all_mid=np.stack([bits[t] for t in mid_tiers]) if mid_tiers else empty)
        w._serve_bits = (self.shared_gen, words, sb)
        return sb

    def _stored(self, w: Worker, ev: BlockStored, ops: PendingOps) -> None:
        hashes = ev.block_hashes
        if not hashes:
            return  # vLLM's Mamba events sometimes carry token ids only
        seen = (ev.medium, ev.locality, ev.ownership, ev.group_idx, ev.kv_cache_spec_kind, ev.block_size)
        hid = w.seen.get(seen)
        if hid is not None and not w.learns:  # an event like one before: nothing new to learn
            ops.add(hashes, hid, STORE)
            return
        if w.as_int is None:
            w.as_int = isinstance(hashes[0], int)
            if self.as_int is None:
                self.as_int = w.as_int
        kind = ev.kv_cache_spec_kind
        if kind in IGNORED_KINDS:
            return
        tier = event_tier(ev)
        if kind is None and tier != TIER_GPU:  # a bare tier event (vLLM's offloading placeholders)
            kind = w.group_kinds.get(ev.group_idx)
        elif kind is not None and tier == TIER_GPU and ev.group_idx not in w.group_kinds:
            self._learn_group_kind(w, ev.group_idx, kind)
        holder = self._holder(w, tier, ev.group_idx, kind)
        is_state = kind in STATE_KINDS
        if tier == TIER_GPU and not is_state:
            bs = ev.block_size
            if w.config.hash_block_size is None and (w.unit is None or bs < w.unit):
                w.unit = bs
        if w.config.block_size is None and (w.block_size is None or ev.block_size > w.block_size):
            w.block_size = ev.block_size
        ops.add(hashes, holder.id, STORE)
        w.seen[seen] = holder.id
        if w.learns and not is_state and ev.token_ids and ev.block_size == w.unit:
            self._learn(w, ev)

    def _learn_group_kind(self, w: Worker, group: int | None, kind: str) -> None:
        """A group's kind, from its GPU events: also the kind of its tier holders that were
        announced without one (vLLM 0.32's offloading placeholders, a disk tier's restart index)."""
        w.group_kinds[group] = kind
        shared = [(k, h) for k, h in self.shared.items() if k[0] in w.remote_tiers]
        for (tier, g), holder in [*w.holders.items(), *shared]:
            if g == group and holder.kind is None and tier != TIER_GPU:
                self._holder(w, tier, g, kind)

    def _learn(self, w: Worker, ev: BlockStored) -> None:
        bs, parent, keys = ev.block_size, ev.parent_block_hash, ev.extra_keys
        for i, h in enumerate(ev.block_hashes):
            toks = ev.token_ids[i * bs:(i + 1) * bs]
            if len(toks) < bs:
                break
            k = (parent, tuple(toks), frozen_keys(keys[i]) if keys and i < len(keys) else None)
            w.learned[k] = h
            w.learned_key[h] = k
            parent = h

    def _removed(self, w: Worker, ev: BlockRemoved, ops: PendingOps) -> None:
        tier = event_tier(ev)
        holder = (self.shared if tier.locality == LOCALITY_REMOTE else w.holders).get((tier, ev.group_idx))
        if holder is None:
            self._unknown += len(ev.block_hashes)
            return
        ops.add(ev.block_hashes, holder.id, REMOVE)
        if w.learns:  # forget what the worker no longer holds anywhere (one event at a time)
            self._flush()
            gone = set(ev.block_hashes) - self._held_keys(w.holder_ids, ev.block_hashes)
            for h in gone:
                k = w.learned_key.pop(h, None)
                if k is not None and w.learned.get(k) == h:
                    del w.learned[k]

    def _held_keys(self, holder_ids: list, hashes: Sequence) -> set:
        """Those of `hashes` any of `holder_ids` holds."""
        keys = hash_keys(hashes)
        masks = np.zeros((len(keys), self.table.words), np.uint64)
        self.table.lookup(keys, masks)
        held = (masks & self.table.bits(holder_ids)).any(axis=1)
        return {h for h, y in zip(hashes, held) if y}

    # ---- queries ----
    def match(self, token_ids: Sequence[int], extra_keys: Sequence[tuple | None] | None = None,
              lora: tuple[str, str] | None = None, cache_salt: str | None = None) -> dict[tuple, WorkerMatch]:
        """Per worker `(instance, dp rank)`: the tokens of this prompt it will serve from cache.

        `extra_keys`: per hash unit, vLLM's multimodal keys `("mm", identifier, offset)` (or any
        keys vLLM hashes besides LoRA and cache salt), as `unit_extra_keys` builds them; `lora`:
        (name, path) of the request's adapter; `cache_salt`: the request's salt."""
        self._flush()
        n = len(token_ids)
        out: dict[tuple, WorkerMatch] = {}
        looked: dict[tuple, np.ndarray] = {}  # (algo, seed, unit) -> the prompt's holder bits per unit
        unit_keys: dict[int, list | None] = {}  # unit -> extra keys per unit
        for key, w in self.workers.items():
            unit = w.unit or self._fleet_unit(w)
            stale = self.is_stale(key[0])
            if unit is None or n <= 1 or (w.as_int is None and self.as_int is None):
                out[key] = WorkerMatch(0, {}, stale)
                continue
            n_units = n // unit  # a GPU hit never covers the last token, a tier hit's last block may (tier_hit)
            if unit not in unit_keys:
                unit_keys[unit] = merge_keys(n_units, unit, extra_keys, lora, cache_salt)
            keys = unit_keys[unit]
            if w.learns:
                masks = self._masks(hash_keys(self._walk_learned(w, token_ids, unit, n_units, keys)), n_units)
            else:
                hk = (w.hasher.algo, w.hasher.seed, unit)
                if hk not in looked:
                    if keys:
                        hs = w.hasher.event_hashes(token_ids, unit, n_units, keys)
                        masks = self._masks(hash_keys(hs), n_units)
                    else:
                        masks = self._masks_chunks(w.hasher.event_hash_chunks(token_ids, unit, n_units),
                                                   n_units, self._widest_block(hk))
                    looked[hk] = masks
                masks = looked[hk]
            out[key] = self._serve(w, masks, n, stale, unit)
        return out

    def match_keys(self, keys: np.ndarray, n: int, unit: int) -> dict[tuple, WorkerMatch]:
        """`match` of a prompt hashed by the caller: `keys`, its units' event hashes as uint64
        (vLLM's int form: the digest's last 8 bytes), in hash unit `unit`; `n`, its tokens. Only
        the workers matched in that unit are answered."""
        self._flush()
        workers = [(k, w) for k, w in self.workers.items() if (w.unit or self._fleet_unit(w)) == unit]
        if not workers or n <= 1:
            return {k: WorkerMatch(0, {}, self.is_stale(k[0])) for k, _ in workers}
        n_units = min(len(keys), n // unit)
        masks = np.zeros((n_units, self.table.words), np.uint64)
        self.table.lookup(keys[:n_units], masks, run=self._widest_block((None, None, unit)))
        return {k: self._serve(w, masks, n, self.is_stale(k[0]), unit) for k, w in workers}

    def n_held(self) -> int:
        """How many distinct hashes some worker or shared tier holds."""
        self._flush()
        return len(self.table)

    def unit(self, instance: Hashable, dp: int = 0) -> int | None:
        """The hash unit `instance` is matched in (None: not known yet)."""
        w = self.workers.get((instance, dp))
        return None if w is None else (w.unit or self._fleet_unit(w))

    def _fleet_unit(self, w: Worker) -> int | None:
        """A worker that announced no GPU block yet (a new instance reading a shared tier) hashes
        as the fleet's workers of its algorithm and seed do: their smallest unit."""
        return min((o.unit for o in self._alike(w) if o.unit), default=None)

    def _fleet_block_size(self, w: Worker) -> int | None:
        """As `_fleet_unit`, the block size: the largest of the alike workers'."""
        return max((o.block_size for o in self._alike(w) if o.block_size), default=None)

    def _alike(self, w: Worker) -> Iterator[Worker]:
        return (o for o in self.workers.values() if (o.hasher.algo, o.hasher.seed) == (w.hasher.algo, w.hasher.seed))

    def _walk_learned(self, w: Worker, token_ids: Sequence[int], unit: int, n_units: int,
                      keys: list[tuple | None] | None) -> list[BlockHash]:
        learned, parent, hs = w.learned, None, []
        for u in range(n_units):
            k = (parent, tuple(token_ids[u * unit:(u + 1) * unit]), event_extra_keys(keys[u]) if keys else None)
            h = learned.get(k)
            if h is None:
                break
            hs.append(h)
            parent = h
        return hs

    def _masks(self, keys: np.ndarray, n_units: int) -> np.ndarray:
        """The holder bits of a prompt's hash keys per unit (zero past `keys`), shared by every
        worker hashing alike."""
        masks = np.zeros((n_units, self.table.words), np.uint64)
        self.table.lookup(keys[:n_units], masks)
        return masks

    def _masks_chunks(self, chunks: Iterable[list[Any]], n_units: int, run: int) -> np.ndarray:
        """`_masks` over hashes computed chunk by chunk, stopping after `run` consecutive units
        nobody holds: that run holds a block end of every worker, so no hit reaches past it."""
        masks = np.zeros((n_units, self.table.words), np.uint64)
        start = zeros = 0
        for hs in chunks:
            zeros = self.table.lookup(hash_keys(hs), masks, start, zeros, run)
            start += len(hs)
            if zeros >= run:
                break
        return masks

    def _widest_block(self, hk: tuple[str | None, str | None, int]) -> int:
        """The most units per block among the workers hashing as `hk` (algo, seed, unit; None
        algo and seed: any)."""
        algo, seed, unit = hk
        return max(((w.block_size or unit) // unit for w in self.workers.values()
                    if (w.unit or unit) == unit and (algo is None or (w.hasher.algo, w.hasher.seed) == (algo, seed))),
                   default=1) or 1

    def _serve(self, w: Worker, masks: np.ndarray, n: int, stale: bool, unit: int) -> WorkerMatch:
        sb = self._serve_bits(w)
        gpu = 0
        if sb.gpu_kv is not None:
            gpu = gpu_hit_units(masks, sb.gpu_kv, sb.gpu_st, sb.hybrid, (n - 1) // unit) * unit
        result = {TIER_GPU: gpu}
        total = gpu
        if sb.others:
            B = w.block_size or self._fleet_block_size(w) or unit
            for t in sb.others:
                result[t] = max(gpu, tier_hit(gpu, n, unit, B, sb.hybrid, masks, sb.single[t], sb.mid[t]))
            total = max(gpu, tier_hit(gpu, n, unit, B, sb.hybrid, masks, sb.all_tiers, sb.all_mid))
        return WorkerMatch(total, result, stale)

    def held(self, instance: Hashable, dp: int | None = None, tier: Tier = TIER_GPU,
             group: int | None = None) -> set[int]:
        """The hashes (as 64-bit keys, `hash_key`) a worker holds in a tier (and group), a shared
        REMOTE tier's for any worker: for tests and inspection."""
        self._flush()
        w = self.workers.get((instance, dp))
        holders = self.shared if tier.locality == LOCALITY_REMOTE else (w.holders if w else {})
        return self.table.held_by([h.id for (t, g), h in holders.items()
                                   if t == tier and (group is None or g == group)])
