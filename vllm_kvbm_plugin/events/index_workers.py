"""The router index's per-worker state (events/index.py): a worker's config (`WorkerConfig`),
what it is predicted to serve (`WorkerMatch`), its holders, hasher and learned hashes (`Worker`),
the holder bits it serves from (`ServeBits`), and the stores and removals waiting for the table
(`PendingOps`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from vllm_kvbm_plugin.events.held_table import REMOVE, STORE, HeldTable, hash_keys
from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher, unit_extra_keys
from vllm_kvbm_plugin.events.types import MEDIUM_GPU, BlockRemoved, BlockStored, Tier

STATE_KINDS = frozenset({"mamba"})
# groups that keep only some blocks (sliding windows): not modelled, never block a match
IGNORED_KINDS = frozenset({"sliding_window", "sliding_window_mla", "chunked_local_attention"})
TIER_GPU = Tier(MEDIUM_GPU)
CONNECTORS = ("KVBMConnector", "OffloadingConnector")  # WorkerConfig.connector: whose tier rule
REMOTE_READS = ("announced", "all", "none")  # WorkerConfig.remote


def frozen_keys(x: Any) -> Any:
    """Decoded event extra keys (lists) as hashable tuples."""
    if isinstance(x, list):
        return tuple(frozen_keys(v) for v in x)
    return x


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

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise ValueError(f"WorkerConfig.connector: {self.connector!r}; valid: {', '.join(CONNECTORS)}")
        if self.remote not in REMOTE_READS:
            raise ValueError(f"WorkerConfig.remote: {self.remote!r}; valid: {', '.join(REMOTE_READS)}")


class WorkerMatch(NamedTuple):
    """What `KVIndex.match` predicts for one worker (a router's process reads it)."""

    tokens: int  # what the worker will serve: its GPU prefix cache, then its own offload tiers
    tiers: dict  # Tier -> tokens with that tier alone (GPU: the prefix-cache hit; others: after it)
    stale: bool  # events were lost: the numbers may be wrong until replay recovers them


@dataclasses.dataclass
class Holder:
    """One (worker, tier, group): its number in the table of held hashes (HeldTable), and its kind."""
    id: int
    kind: str | None


class ServeBits(NamedTuple):
    """What a worker serves from, as holder bits (rows of HeldTable words), cached per worker."""
    hybrid: bool  # it or a shared tier it reads announced states
    gpu_kv: np.ndarray | None  # its GPU attention groups' bits (None: no GPU attention event yet)
    gpu_st: np.ndarray
    others: tuple  # its offload tiers (own and shared)
    single: dict  # tier -> [[attention bits, state bits]]
    mid: dict  # tier -> the same, or none: the tiers a state inside a block may come from
    all_tiers: np.ndarray  # every offload tier's [attention bits, state bits]
    all_mid: np.ndarray


class PendingOps:
    """Stores and removals gathered for one HeldTable.apply: runs of hashes, in stream order."""

    def __init__(self) -> None:
        self.hashes: list = []  # the event hashes as they came (a list grows ~5x faster than an array)
        self.counts = [0, 0]  # hashes removed, stored (by op)
        self.ends: list[int] = []
        self.holders: list[int] = []
        self.ops: list[int] = []

    def __len__(self) -> int:
        return len(self.hashes)

    def add(self, hashes: Sequence, holder: int, op: int) -> None:
        """A run of `hashes` stored in (STORE) or removed from (REMOVE) `holder`."""
        self.hashes += hashes
        self.ends.append(len(self.hashes))
        self.counts[op] += len(hashes)
        self.holders.append(holder)
        self.ops.append(op)

    def flush(self, table: HeldTable, stats: dict) -> None:
        """Apply the runs to `table` (counted in `stats`) and forget them."""
        if self.ends:
            stats["removed"] += self.counts[REMOVE]
            stats["stored"] += self.counts[STORE]
            table.apply(hash_keys(self.hashes), np.array(self.ends, np.int64),
                        np.array(self.holders, np.int64), np.array(self.ops, np.int8))
            self.hashes, self.ends, self.holders, self.ops = [], [], [], []
            self.counts = [0, 0]


class Worker:
    """One worker `(instance, dp rank)` as the index knows it."""

    def __init__(self, key: tuple, config: WorkerConfig, remote_tiers: set) -> None:
        self.key = key
        self.config = config
        self.hasher = PromptHasher(config.hash_algo, config.seed)
        self.learns = not self.hasher.computable  # its hashes are learned from its events
        self.unit = config.hash_block_size
        self.block_size = config.block_size
        self.as_int: bool | None = None  # event hash form, seen on the first hash
        self.holders: dict[tuple, Holder] = {}  # (tier, group) -> holder
        self.hybrid = False
        self.group_kinds: dict = {}  # group -> kind, from GPU events (tier events may lack it)
        self.holder_ids: list[int] = []  # its own tiers' holders
        # (medium, locality, ownership, group, kind, block size) of its events -> their holder
        self.seen: dict[tuple, int] = {}
        self.remote_tiers = remote_tiers  # shared REMOTE tiers its stream announced blocks in (kept over resets)
        self._serve_bits: tuple | None = None  # (KVIndex.shared_gen, words, ServeBits), see KVIndex._serve_bits
        # learned (parent, tokens, extra keys) -> hash, for workers whose hashes cannot be computed
        self.learned: dict[tuple, Any] = {}
        self.learned_key: dict[Any, tuple] = {}


def event_tier(ev: BlockStored | BlockRemoved) -> Tier:
    """The tier an event's blocks are in."""
    medium = ev.medium or MEDIUM_GPU
    return Tier(medium, ev.locality, ev.ownership) if medium != MEDIUM_GPU else TIER_GPU


def merge_keys(n_units: int, unit: int, extra_keys: Sequence[tuple | None] | None, lora: tuple[str, str] | None,
               cache_salt: str | None) -> list[tuple | None] | None:
    """A request's extra keys per hash unit (LoRA, images or other keys, salt), None if none."""
    if extra_keys is None and lora is None and not cache_salt:
        return None
    base = unit_extra_keys(n_units, unit, (), lora, None) or [None] * n_units
    out: list[tuple | None] = []
    for u in range(n_units):
        keys = list(base[u] or ())
        extra = extra_keys[u] if extra_keys is not None and u < len(extra_keys) else None
        if extra:
            keys += list(extra)
        if cache_salt and u == 0:
            keys.append(("cache_salt", cache_salt))
        out.append(tuple(keys) if keys else None)
    return out if any(out) else None
