"""A router-like index of a KV event stream that reports every inconsistency it sees.

The index holds, per (data-parallel rank, medium, group, block size), the block hashes currently
announced. Rules checked:
- unknown_parent: a BlockStored whose parent hash is not held at the same block size;
- duplicate_store: a hash stored again while still held at the same block size;
- unknown_removal: a BlockRemoved hash that is not held at any block size of its group;
- token_count: len(token_ids) != len(block_hashes) * block_size.
Groups of sparse kinds (Mamba state, sliding windows) keep only some blocks, so vLLM announces
fewer hashes than token blocks and parents that were never stored: for them the first and last
rule are relaxed to "token count is a multiple of block_size and covers the hashes".

BlockRemoved carries no block size. A hash at an inflated-block boundary is also the hash of that
block's last unit, so with coarse and per-unit events both on the same hash is held at two sizes;
a removal takes the largest size first, the order in which the plugin emits them.
AllBlocksCleared clears the GPU medium (vLLM emits it from the GPU prefix cache reset).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from vllm_kvbm_plugin.events.types import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

SPARSE_KINDS = frozenset(
    {"mamba", "sliding_window", "sliding_window_mla", "chunked_local_attention"}
)
RULES = ("unknown_parent", "duplicate_store", "unknown_removal", "token_count")


@dataclasses.dataclass(frozen=True)
class Problem:
    rule: str
    seq: int | None
    detail: str


class Validator:
    def __init__(self, max_problems_kept: int = 1000):
        # (dp, medium, group) -> block size -> held hashes
        self._held: dict[tuple, dict[int, set]] = {}
        self.counts: Counter[str] = Counter()
        self.problems: list[Problem] = []
        self.max_problems_kept = max_problems_kept
        self.batches = 0
        self.stored_hashes = 0
        self.removed_hashes = 0
        self.stored_by: Counter[str] = Counter()  # "medium/g<group>/<kind>/<block size>" -> hashes

    @property
    def errors(self) -> int:
        return sum(self.counts[r] for r in RULES)

    def held(self, medium: str = MEDIUM_GPU, group: int | None = None, block_size: int | None = None,
             dp: int | None = None) -> set:
        """Hashes currently held (for assertions and inspection)."""
        out: set = set()
        for (d, m, g), sizes in self._held.items():
            if m == medium and (group is None or g == group) and (dp is None or d == dp):
                for bs, hashes in sizes.items():
                    if block_size is None or bs == block_size:
                        out |= hashes
        return out

    def apply(self, batch: KVEventBatch, seq: int | None = None) -> None:
        self.batches += 1
        dp = batch.data_parallel_rank
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(dp, ev, seq)
            elif isinstance(ev, BlockRemoved):
                self._removed(dp, ev, seq)
            elif isinstance(ev, AllBlocksCleared):
                for key in [k for k in self._held if k[0] == dp and k[1] in (MEDIUM_GPU, None)]:
                    del self._held[key]

    def _stored(self, dp, ev: BlockStored, seq) -> None:
        gkey = (dp, ev.medium, ev.group_idx)
        sparse = ev.kv_cache_spec_kind in SPARSE_KINDS
        held = self._held.setdefault(gkey, {}).setdefault(ev.block_size, set())
        hashes = ev.block_hashes
        n_tokens = len(ev.token_ids)
        if sparse:
            if n_tokens % ev.block_size or n_tokens < len(hashes) * ev.block_size:
                self._problem("token_count", seq, f"{n_tokens} tokens for {len(hashes)} hashes of {ev.block_size} (sparse group {gkey})")
        elif n_tokens != len(hashes) * ev.block_size:
            self._problem("token_count", seq, f"{n_tokens} tokens for {len(hashes)} hashes of {ev.block_size} in {gkey}")
        if not sparse and ev.parent_block_hash is not None and ev.parent_block_hash not in held:
            self._problem("unknown_parent", seq, f"parent {_short(ev.parent_block_hash)} of {_short(hashes[0]) if hashes else '-'} not held in {gkey} at block size {ev.block_size}")
        # set operations run in C, so the validator keeps up with large streams
        dup = held.intersection(hashes)
        before = len(held)
        held.update(hashes)
        for h in dup:
            self._problem("duplicate_store", seq, f"{_short(h)} already held in {gkey} at block size {ev.block_size}")
        if len(held) - before != len(hashes) - len(dup):
            self._problem("duplicate_store", seq, f"a hash repeats within one event in {gkey}")
        self.stored_hashes += len(hashes)
        self.stored_by[f"{ev.medium}/g{ev.group_idx}/{ev.kv_cache_spec_kind}/{ev.block_size}"] += len(hashes)

    def _removed(self, dp, ev: BlockRemoved, seq) -> None:
        sizes = self._held.get((dp, ev.medium, ev.group_idx), {})
        rest = ev.block_hashes
        for bs in sorted(sizes, reverse=True):  # largest block size first
            hit = sizes[bs].intersection(rest)
            if hit:
                sizes[bs].difference_update(hit)
                rest = [h for h in rest if h not in hit] if len(hit) < len(rest) else []
            if not rest:
                break
        for h in rest:
            self._problem("unknown_removal", seq, f"{_short(h)} not held in {(dp, ev.medium, ev.group_idx)}")
        self.removed_hashes += len(ev.block_hashes)

    def _problem(self, rule: str, seq, detail: str) -> None:
        self.counts[rule] += 1
        if len(self.problems) < self.max_problems_kept:
            self.problems.append(Problem(rule, seq, detail))

    def report(self) -> dict:
        return {
            "batches": self.batches,
            "stored_hashes": self.stored_hashes,
            "removed_hashes": self.removed_hashes,
            "stored_by": dict(sorted(self.stored_by.items())),
            "held_hashes": sum(len(s) for sizes in self._held.values() for s in sizes.values()),
            "errors": self.errors,
            "by_rule": {r: self.counts[r] for r in RULES},
            "first_problems": [dataclasses.asdict(p) for p in self.problems[:20]],
        }


def _short(h) -> str:
    return h.hex()[:16] if isinstance(h, bytes) else f"{h:#x}" if isinstance(h, int) else repr(h)
