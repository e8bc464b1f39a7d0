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
(the plugin's coarse and unit events announce one hash at two block sizes), `AllBlocksCleared`
empties the worker's GPU tier, and a batch lost in transit (a sequence gap) marks the instance
stale: later batches wait until the missing ones are applied (the subscriber's replay) or the
instance is reset.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher, event_extra_keys, unit_extra_keys
from vllm_kvbm_plugin.events.types import (
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Tier,
)
from vllm_kvbm_plugin.log import get_logger

logger = get_logger("index")

STATE_KINDS = frozenset({"mamba"})
# groups that keep only some blocks (sliding windows): not modelled, never block a match
IGNORED_KINDS = frozenset({"sliding_window", "sliding_window_mla", "chunked_local_attention"})
TIER_GPU = Tier(MEDIUM_GPU)
CONNECTORS = ("KVBMConnector", "OffloadingConnector")  # WorkerConfig.connector: whose tier rule
REMOTE_READS = ("announced", "all", "none")  # WorkerConfig.remote
_MAX_PENDING = 10_000  # batches kept per stale instance while waiting for the missing ones


def _frozen(x):
    """Decoded event extra keys (lists) as hashable tuples."""
    if isinstance(x, list):
        return tuple(_frozen(v) for v in x)
    return x


# ---- the index -----------------------------------------------------------------------------------

@dataclasses.dataclass
class WorkerConfig:
    """What the index must know about a worker to hash prompts as it does. Sizes left None are
    learned from its events: the hash unit is the smallest block size of its GPU attention events,
    the block size the largest of all its events."""
    hash_algo: str = "sha256"  # --prefix-caching-hash-algo
    seed: str | None = None  # the worker's PYTHONHASHSEED, if set
    hash_block_size: int | None = None
    block_size: int | None = None
    # whose rule serves the offload tiers: "KVBMConnector", or "OffloadingConnector" (vLLM's, with
    # any tiers): a hybrid's state inside a block (a partial tail) then comes from the CPU tier
    # only, since vLLM loads it only when it is there at the lookup (module docstring)
    connector: str = "KVBMConnector"
    # which shared REMOTE tiers the worker reads: "announced" (those its own stream announced a
    # block in: a worker that never wrote there is not known to read them), "all" (every one any
    # stream announced: a fleet on one Redis and one model), "none"
    remote: str = "announced"

    def __post_init__(self):
        if self.connector not in CONNECTORS:
            raise ValueError(f"WorkerConfig.connector: {self.connector!r}; valid: {', '.join(CONNECTORS)}")
        if self.remote not in REMOTE_READS:
            raise ValueError(f"WorkerConfig.remote: {self.remote!r}; valid: {', '.join(REMOTE_READS)}")


class WorkerMatch(NamedTuple):
    """What `KVIndex.match` predicts for one worker (a router's process reads it)."""

    tokens: int  # what the worker will serve: its GPU prefix cache, then its own offload tiers
    tiers: dict  # Tier -> tokens with that tier alone (GPU: the prefix-cache hit; others: after it)
    stale: bool  # events were lost: the numbers may be wrong until replay recovers them


class _Looked(NamedTuple):
    kv_masks: list  # per unit: bits of the attention holders of its hash
    state_masks: list  # per unit: bits of the state holders of its hash
    acc: list  # running AND of kv_masks: who holds every unit so far
    checkpoints: list  # units (1-based) some state holder holds, ascending


@dataclasses.dataclass
class _Holder:
    """One (worker, tier, group): the hashes it holds, with store counts."""
    bit: int
    kind: str | None
    counts: dict = dataclasses.field(default_factory=dict)


class _Worker:
    def __init__(self, key, config: WorkerConfig, remote_tiers: set):
        self.key = key
        self.config = config
        self.hasher = PromptHasher(config.hash_algo, config.seed)
        self.unit = config.hash_block_size
        self.block_size = config.block_size
        self.as_int: bool | None = None  # event hash form, seen on the first hash
        self.holders: dict[tuple, _Holder] = {}  # (tier, group) -> holder
        self.hybrid = False
        self.group_kinds: dict = {}  # group -> kind, from GPU events (tier events may lack it)
        self.bits = 0  # every holder bit of this worker (its own tiers)
        self.remote_tiers = remote_tiers  # shared REMOTE tiers its stream announced blocks in (kept over resets)
        self._tier_bits: tuple | None = None  # (KVIndex.shared_gen, tier -> bits), see KVIndex._tier_bits
        # learned (parent, tokens, extra keys) -> hash, for workers whose hashes cannot be computed
        self.learned: dict[tuple, Any] = {}
        self.learned_key: dict[Any, tuple] = {}

    @property
    def learns(self) -> bool:
        return not self.hasher.computable


class KVIndex:
    """A router's view of what every worker of a fleet holds (module docstring): owns, per worker,
    its config, hasher and held hashes per tier and group, and per instance the event sequence
    (gaps, stale batches). Fed by the router's subscribers (`apply`), asked by its request
    handler (`match`); runs in the router's process (router.py, `vllm-kvbm route`), or
    embedded in another router. Workers are named `(instance, data-parallel rank)`."""

    def __init__(self, default: WorkerConfig | None = None):
        self.default = default or WorkerConfig()
        self.configs: dict[Any, WorkerConfig] = {}  # instance -> config
        self.workers: dict[tuple, _Worker] = {}
        # hash -> bits of the (worker, tier, group)s holding it; attention and state holders have
        # bits of their own, so one lookup per unit serves both
        self.held_by: dict[Any, int] = {}
        # shared REMOTE tiers: (tier, group) -> holder, one for every stream (module docstring);
        # shared_gen changes whenever one is added or learns its kind (workers' tier bits then)
        self.shared: dict[tuple, _Holder] = {}
        self.shared_gen = 0
        self.as_int: bool | None = None  # the hash form of the first hash any stream announced
        # worker -> the shared tiers it announced into: it still reads them after a restart
        self.remote_reads: dict[tuple, set] = {}
        self._next_bit = 1
        self._state_bits = 0  # bits of every state holder
        # per instance: next expected seq, missing seqs, batches waiting behind a gap
        self.next_seq: dict[Any, int] = {}
        self.missing: dict[Any, set] = {}
        self.pending: dict[Any, dict[int, KVEventBatch]] = {}
        self.stats = {"batches": 0, "stored": 0, "removed": 0, "unknown_removals": 0, "gaps": 0}

    # ---- configuration ----
    def add_instance(self, instance, config: WorkerConfig | None = None, ranks=()) -> None:
        """`instance`'s config; with `ranks` (data-parallel ranks), its workers are matched from
        now on, before their first event (a new instance may serve a shared remote tier's blocks)."""
        self.configs[instance] = config or self.default
        for dp in ranks:
            self._worker(instance, dp)

    def _worker(self, instance, dp) -> _Worker:
        key = (instance, dp)
        w = self.workers.get(key)
        if w is None:
            w = self.workers[key] = _Worker(key, self.configs.get(instance, self.default),
                                            self.remote_reads.setdefault(key, set()))
        return w

    # ---- events ----
    def apply(self, instance, batch: KVEventBatch, seq: int | None = None) -> None:
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
            self.stats["gaps"] += 1
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

    def _drain(self, instance) -> None:
        missing, pending = self.missing.get(instance, set()), self.pending.get(instance, {})
        for s in sorted(pending):
            if any(m < s for m in missing):
                break
            self._apply(instance, pending.pop(s))

    def is_stale(self, instance) -> bool:
        return bool(self.missing.get(instance))

    def reset(self, instance) -> None:
        """Forget everything `instance` announced (it restarted, or a gap will never be recovered)."""
        for key in [k for k in self.workers if k[0] == instance]:
            w = self.workers.pop(key)
            for holder in w.holders.values():
                self._clear(holder)
            if instance in self.configs:  # a configured instance stays matched (add_instance)
                self._worker(*key)
        self.next_seq.pop(instance, None)
        self.missing.pop(instance, None)
        self.pending.pop(instance, None)

    def _apply(self, instance, batch: KVEventBatch) -> None:
        self.stats["batches"] += 1
        w = self._worker(instance, batch.data_parallel_rank)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(w, ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(w, ev)
            elif isinstance(ev, AllBlocksCleared):
                if w.remote_tiers and not w.holders:  # the remote tier's announcer: the store was flushed
                    for (tier, _), holder in self.shared.items():
                        if tier in w.remote_tiers:
                            self._clear(holder)
                for (tier, _), holder in w.holders.items():
                    if tier == TIER_GPU:
                        self._clear(holder)

    def _holder(self, w: _Worker, tier: Tier, group, kind) -> _Holder:
        if tier.locality == LOCALITY_REMOTE:
            return self._shared_holder(w, tier, group, kind)
        holder = w.holders.get((tier, group))
        if holder is None:
            holder = w.holders[(tier, group)] = _Holder(self._next_bit, kind)
            self._next_bit <<= 1
            w.bits |= holder.bit
            if kind in STATE_KINDS:
                self._state_bits |= holder.bit
            w._tier_bits = None
            if kind in STATE_KINDS:
                w.hybrid = True
        elif holder.kind is None and kind is not None:
            holder.kind = kind
            w._tier_bits = None
            w.hybrid = w.hybrid or kind in STATE_KINDS
            if kind in STATE_KINDS:
                self._state_bits |= holder.bit
        return holder

    def _shared_holder(self, w: _Worker, tier: Tier, group, kind) -> _Holder:
        """The fleet's holder of a shared REMOTE tier's group; `w` announced into it."""
        if tier not in w.remote_tiers:
            w.remote_tiers.add(tier)
            w._tier_bits = None
        holder = self.shared.get((tier, group))
        if holder is None:
            holder = self.shared[(tier, group)] = _Holder(self._next_bit, kind)
            self._next_bit <<= 1
            self.shared_gen += 1
        elif holder.kind is None and kind is not None:
            holder.kind = kind
            self.shared_gen += 1
        else:
            return holder
        if kind in STATE_KINDS:
            self._state_bits |= holder.bit
        return holder

    def _tier_bits(self, w: _Worker) -> dict:
        """Tier -> (attention holder bits, state holder bits) of what `w` serves from: its own
        tiers and the shared REMOTE tiers it reads (`WorkerConfig.remote`)."""
        if w._tier_bits is not None and w._tier_bits[0] == self.shared_gen:
            return w._tier_bits[1]
        out: dict[Tier, tuple[int, int]] = {}
        reads = w.config.remote
        shared = [(k, h) for k, h in self.shared.items()
                  if reads == "all" or (reads == "announced" and k[0] in w.remote_tiers)]
        for (tier, _), holder in itertools.chain(w.holders.items(), shared):
            kv_bits, st_bits = out.get(tier, (0, 0))
            if holder.kind in STATE_KINDS:
                st_bits |= holder.bit
            else:
                kv_bits |= holder.bit
            out[tier] = (kv_bits, st_bits)
        w._tier_bits = (self.shared_gen, out)
        return out

    def _stored(self, w: _Worker, ev: BlockStored) -> None:
        hashes = ev.block_hashes
        if not hashes:
            return  # vLLM's Mamba events sometimes carry token ids only
        if w.as_int is None:
            w.as_int = isinstance(hashes[0], int)
            if self.as_int is None:
                self.as_int = w.as_int
        kind = ev.kv_cache_spec_kind
        if kind in IGNORED_KINDS:
            return
        tier = _tier(ev)
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
        table = self.held_by
        counts, bit = holder.counts, holder.bit
        for h in hashes:
            c = counts.get(h, 0)
            counts[h] = c + 1
            if not c:
                table[h] = table.get(h, 0) | bit
        self.stats["stored"] += len(hashes)
        if w.learns and not is_state and ev.token_ids and ev.block_size == w.unit:
            self._learn(w, ev)

    def _learn_group_kind(self, w: _Worker, group, kind: str) -> None:
        """A group's kind, from its GPU events: also the kind of its tier holders that were
        announced without one (vLLM 0.32's offloading placeholders, a disk tier's restart index)."""
        w.group_kinds[group] = kind
        shared = [(k, h) for k, h in self.shared.items() if k[0] in w.remote_tiers]
        for (tier, g), holder in [*w.holders.items(), *shared]:
            if g == group and holder.kind is None and tier != TIER_GPU:
                self._holder(w, tier, g, kind)

    def _learn(self, w: _Worker, ev: BlockStored) -> None:
        bs, parent, keys = ev.block_size, ev.parent_block_hash, ev.extra_keys
        for i, h in enumerate(ev.block_hashes):
            toks = ev.token_ids[i * bs:(i + 1) * bs]
            if len(toks) < bs:
                break
            k = (parent, tuple(toks), _frozen(keys[i]) if keys and i < len(keys) else None)
            w.learned[k] = h
            w.learned_key[h] = k
            parent = h

    def _removed(self, w: _Worker, ev: BlockRemoved) -> None:
        tier = _tier(ev)
        holder = (self.shared if tier.locality == LOCALITY_REMOTE else w.holders).get((tier, ev.group_idx))
        if holder is None:
            self.stats["unknown_removals"] += len(ev.block_hashes)
            return
        table = self.held_by
        counts, bit = holder.counts, holder.bit
        for h in ev.block_hashes:
            c = counts.get(h, 0)
            if c > 1:
                counts[h] = c - 1
            elif c == 1:
                del counts[h]
                self._drop_bit(table, h, bit, w)
            else:
                self.stats["unknown_removals"] += 1
        self.stats["removed"] += len(ev.block_hashes)

    def _drop_bit(self, table: dict, h, bit: int, w: _Worker) -> None:
        m = table.get(h, 0) & ~bit
        if m:
            table[h] = m
        else:
            table.pop(h, None)
        if w.learns and not (table.get(h, 0) & w.bits):
            k = w.learned_key.pop(h, None)
            if k is not None and w.learned.get(k) == h:
                del w.learned[k]

    def _clear(self, holder: _Holder) -> None:
        table = self.held_by
        bit = holder.bit
        for h in holder.counts:
            m = table.get(h, 0) & ~bit
            if m:
                table[h] = m
            else:
                table.pop(h, None)
        holder.counts = {}

    # ---- queries ----
    def match(self, token_ids: Sequence[int], extra_keys: Sequence[tuple | None] | None = None,
              lora: tuple[str, str] | None = None, cache_salt: str | None = None) -> dict[tuple, WorkerMatch]:
        """Per worker `(instance, dp rank)`: the tokens of this prompt it will serve from cache.

        `extra_keys`: per hash unit, vLLM's multimodal keys `("mm", identifier, offset)` (or any
        keys vLLM hashes besides LoRA and cache salt), as `unit_extra_keys` builds them; `lora`:
        (name, path) of the request's adapter; `cache_salt`: the request's salt."""
        n = len(token_ids)
        out: dict[tuple, WorkerMatch] = {}
        hashed: dict[tuple, _Looked] = {}  # (algo, seed, unit, form) -> the prompt's masks
        unit_keys: dict[int, list | None] = {}  # unit -> extra keys per unit
        for key, w in self.workers.items():
            unit = w.unit or self._fleet_unit(w)
            as_int = w.as_int if w.as_int is not None else self.as_int
            stale = self.is_stale(key[0])
            if unit is None or n <= 1 or as_int is None:
                out[key] = WorkerMatch(0, {}, stale)
                continue
            n_units = n // unit  # a GPU hit never covers the last token, a tier hit's last block may (_tier_hit)
            if unit not in unit_keys:
                unit_keys[unit] = _merge_keys(n_units, unit, extra_keys, lora, cache_salt)
            keys = unit_keys[unit]
            if w.learns:
                looked = self._lookup(self._walk_learned(w, token_ids, unit, n_units, keys))
            else:
                hk = (w.hasher.algo, w.hasher.seed, unit, as_int)
                looked = hashed.get(hk)
                if looked is None:
                    if keys:
                        hs = w.hasher.event_hashes(token_ids, unit, n_units, keys, as_int)
                        looked = self._lookup(hs)
                    else:
                        looked = self._lookup_chunks(w.hasher.event_hash_chunks(token_ids, unit, n_units, as_int),
                                                     self._widest_block(hk))
                    hashed[hk] = looked
            out[key] = self._serve(w, looked, n, stale, unit)
        return out

    def unit(self, instance, dp=0) -> int | None:
        """The hash unit `instance` is matched in (None: not known yet)."""
        w = self.workers.get((instance, dp))
        return None if w is None else (w.unit or self._fleet_unit(w))

    def _fleet_unit(self, w: _Worker) -> int | None:
        """A worker that announced no GPU block yet (a new instance reading a shared tier) hashes
        as the fleet's workers of its algorithm and seed do: their smallest unit."""
        return min((o.unit for o in self._alike(w) if o.unit), default=None)

    def _fleet_block_size(self, w: _Worker) -> int | None:
        """As `_fleet_unit`, the block size: the largest of the alike workers'."""
        return max((o.block_size for o in self._alike(w) if o.block_size), default=None)

    def _alike(self, w: _Worker):
        return (o for o in self.workers.values() if (o.hasher.algo, o.hasher.seed) == (w.hasher.algo, w.hasher.seed))

    def _walk_learned(self, w: _Worker, token_ids, unit, n_units, keys) -> list:
        learned, parent, hs = w.learned, None, []
        for u in range(n_units):
            k = (parent, tuple(token_ids[u * unit:(u + 1) * unit]), event_extra_keys(keys[u]) if keys else None)
            h = learned.get(k)
            if h is None:
                break
            hs.append(h)
            parent = h
        return hs

    def _lookup(self, hs: list) -> "_Looked":
        """The holder masks of a prompt's hashes, shared by every worker hashing alike."""
        get = self.held_by.get
        masks = [get(h, 0) for h in hs]
        acc = list(itertools.accumulate(masks, operator.and_))
        state_bits = self._state_bits
        checkpoints = [u + 1 for u, m in enumerate(masks) if m & state_bits]  # X = that * unit
        return _Looked(masks, masks, acc, checkpoints)

    def _lookup_chunks(self, chunks, run: int) -> "_Looked":
        """`_lookup` over hashes computed chunk by chunk, stopping after `run` consecutive units
        nobody holds: that run holds a block end of every worker, so no hit reaches past it."""
        get, masks, zeros = self.held_by.get, [], 0
        for hs in chunks:
            part = [get(h, 0) for h in hs]
            masks += part
            for m in part:
                zeros = 0 if m else zeros + 1
                if zeros >= run:
                    break
            if zeros >= run:
                break
        acc = list(itertools.accumulate(masks, operator.and_))
        state_bits = self._state_bits
        checkpoints = [u + 1 for u, m in enumerate(masks) if m & state_bits]
        return _Looked(masks, masks, acc, checkpoints)

    def _widest_block(self, hk) -> int:
        """The most units per block among the workers hashing as `hk` (algo, seed, unit, form)."""
        unit = hk[2]
        return max(((w.block_size or unit) // unit for w in self.workers.values()
                    if (w.hasher.algo, w.hasher.seed, w.unit or unit,
                        self.as_int if w.as_int is None else w.as_int) == hk), default=1) or 1

    def _serve(self, w: _Worker, looked: "_Looked", n: int, stale: bool, unit: int) -> WorkerMatch:
        tiers_bits = self._tier_bits(w)
        # a worker that announced no state yet is hybrid if a shared tier it reads holds states
        hybrid = w.hybrid or any(st for _, st in tiers_bits.values())
        gpu_kv, gpu_st = tiers_bits.get(TIER_GPU, (0, 0))
        gpu = 0
        if gpu_kv:
            k = min(bisect.bisect_left(looked.acc, True, key=lambda m: (m & gpu_kv) != gpu_kv), (n - 1) // unit)
            if not hybrid:
                gpu = k * unit
            elif gpu_st:
                gpu = _last_checkpoint(looked.checkpoints, looked.state_masks, gpu_st, k) * unit
        result = {TIER_GPU: gpu}
        others = [t for t in tiers_bits if t != TIER_GPU]
        total = gpu
        if others:
            B = w.block_size or self._fleet_block_size(w) or unit
            args = (gpu, n, unit, B, hybrid, looked.kv_masks, looked.state_masks, looked.checkpoints)
            native = w.config.connector == "OffloadingConnector"
            for t in others:
                mid = [tiers_bits[t]] if not native or t.medium == MEDIUM_CPU else []
                result[t] = max(gpu, _tier_hit(*args, [tiers_bits[t]], mid))
            mid = [tiers_bits[t] for t in others if not native or t.medium == MEDIUM_CPU]
            total = max(gpu, _tier_hit(*args, [tiers_bits[t] for t in others], mid))
        return WorkerMatch(total, result, stale)

    def held(self, instance, dp=None, tier: Tier = TIER_GPU, group=None) -> set:
        """The hashes a worker holds in a tier (and group), a shared REMOTE tier's for any
        worker: for tests and inspection."""
        w = self.workers.get((instance, dp))
        out: set = set()
        holders = self.shared if tier.locality == LOCALITY_REMOTE else (w.holders if w else {})
        for (t, g), holder in holders.items():
            if t == tier and (group is None or g == group):
                out |= holder.counts.keys()
        return out


def _tier(ev) -> Tier:
    medium = ev.medium or MEDIUM_GPU
    return Tier(medium, ev.locality, ev.ownership) if medium != MEDIUM_GPU else TIER_GPU


def _merge_keys(n_units, unit, extra_keys, lora, cache_salt):
    if extra_keys is None and lora is None and not cache_salt:
        return None
    base = unit_extra_keys(n_units, unit, (), lora, None) or [None] * n_units
    out = []
    for u in range(n_units):
        keys = list(base[u] or ())
        if extra_keys is not None and u < len(extra_keys) and extra_keys[u]:
            keys += list(extra_keys[u])
        if cache_salt and u == 0:
            keys.append(("cache_salt", cache_salt))
        out.append(tuple(keys) if keys else None)
    return out if any(out) else None


def _last_checkpoint(checkpoints: list[int], state_masks: list[int], bits: int, limit: int) -> int:
    """The largest checkpoint u <= limit held by every state group in `bits` (0 if none)."""
    i = bisect.bisect_right(checkpoints, limit)
    while i > 0:
        i -= 1
        u = checkpoints[i]
        if state_masks[u - 1] & bits == bits:
            return u
    return 0


def _tier_hit(gpu, n, unit, B, hybrid, kv_masks, state_masks, checkpoints, tiers, mid_tiers) -> int:
    """KVBMConnector's hit after a GPU hit of `gpu` tokens (connector/scheduler.py `_plan`) with
    entries in any of `tiers` [(kv bits, state bits)]: blocks from the GPU hit's block on, and for
    hybrid models the largest X with a tier state at X. 0 when the tiers add nothing. The partial
    KV entry a mid-block state needs is never announced: it is taken to be held with the state."""

    def held(masks, u, which, tiers=tiers):  # unit u (1-based) held in one tier by all its groups of a kind
        if u < 1 or u > len(masks):
            return False
        m = masks[u - 1]
        return any(bits[which] and m & bits[which] == bits[which] for bits in tiers)

    limit = n - 1
    r = max(B // unit, 1)
    start = gpu // B
    full = start
    while (full + 1) * B <= limit and held(kv_masks, (full + 1) * r, 0):
        full += 1
    if not hybrid:
        hit = full * B
        if (full + 1) * B == limit + 1 and held(kv_masks, (full + 1) * r, 0):
            full, hit = full + 1, limit  # a block-aligned prompt's last block, loaded whole
        return hit if full > start else 0
    lo = start * r
    for u in reversed(checkpoints):
        if u > limit // unit or u <= lo:
            if u <= lo:
                break
            continue
        if u // r > full or not held(state_masks, u, 1, tiers if u % r == 0 else mid_tiers):
            continue
        # X inside a block: the connector also needs the block's KV up to X, which it stores with
        # the state as an entry it never announces; a state event stands for both
        return u * unit
    return 0
