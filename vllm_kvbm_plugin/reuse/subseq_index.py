"""Sub-sequence index: which stored hash units occur in a new request, at any offset.

Prefix caching serves a request only the stored blocks that start it. RAG and agent prompts repeat
the same documents at other positions and in other orders; their KV is stored under other keys
(block hashes chain the whole prefix) but their tokens are the same. This index finds them:

- It holds every stored hash unit: its tokens, its key (the block hash), its parent (the unit
  before it in its stored sequence) and its position there, with a store count per holder
  (worker, tier, group) so removals are exact: a unit leaves when its last holder removes it.
- A request is probed with a polynomial rolling hash over every window of `unit` tokens (every
  offset, not only unit boundaries). A blocked Bloom filter turns away almost every window no
  unit holds; the rest are looked up in a compact open-addressing table (rows of hash, slot),
  and **every candidate is verified against the stored tokens**: a 64-bit polynomial hash can
  be collided on purpose, so the hash only proposes. A window one unit after a hit is first
  tried against the hit unit's only child (see `_verify`): inside a reused document the table
  is hardly read.
- Verified hits at offsets s and s + unit whose units are parent and child form a run; every
  maximal run is returned as `Run(new_start, old_start, length, keys)`.

Kernels are numba (`subseq_kernels`: `window_hashes`, `mixed_hashes`, `_candidates`, `_verify`,
`_runs`, one call per request: `find_runs`); `subseq_feed.feed_batch` builds the index from our KV
event stream (BlockStored carries token ids).
"""

from __future__ import annotations

import array
import time
from collections.abc import Callable, Hashable, Sequence
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from vllm_kvbm_plugin.reuse.subseq_kernels import (
    DEFAULT_BASE,
    filter_add,
    find_runs,
    power_tables,
    table_delete,
    table_insert,
    unit_hash,
)

_M64 = (1 << 64) - 1


class Run(NamedTuple):
    """Stored units `keys` (consecutive in their stored sequence, which put the first at token
    `old_start`, -1 if unknown) hold the request's tokens [new_start, new_start + length)."""

    new_start: int
    old_start: int
    length: int
    keys: tuple


class Match(NamedTuple):
    """One request's answer. `prefix_tokens`: what prefix caching already serves (a run from
    position 0 at position 0); `reusable_tokens`: request tokens outside that prefix covered by
    some run, i.e. what only position-independent reuse can serve."""

    runs: list[Run]
    prefix_tokens: int
    reusable_tokens: int
    rejected: int  # candidates whose hash matched but whose tokens did not
    seconds: float




def _inverse(b: int) -> int:
    """b**-1 mod 2**64 for odd b (Newton's iteration doubles the correct low bits each step)."""
    x = b
    for _ in range(6):
        x = x * (2 - b * x) & _M64
    return x


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False)
    return np.frombuffer(array.array("q", tokens), dtype=np.int64)


class SubseqIndex:
    """Stored hash units of `unit` tokens, findable at any offset of a request (module doc)."""

    def __init__(self, unit: int, base: int = DEFAULT_BASE, capacity: int = 1024) -> None:
        if unit < 1:
            raise ValueError(f"unit must be >= 1, got {unit}")
        self.unit = unit
        if not base & 1:
            raise ValueError(f"base must be odd (invertible mod 2**64), got {base}")
        self.base = np.uint64(base & _M64)
        self.inverse = np.uint64(_inverse(base & _M64))
        self.inv_pow, self.mix_pow = power_tables(0, unit, self.base, self.inverse)
        cap = 1 << max(4, (capacity - 1).bit_length())
        self.unit_tokens = np.zeros((cap, unit), np.int64)
        self.parent = np.full(cap, -1, np.int64)  # parent's slot, valid while gen matches
        self.parent_gen = np.zeros(cap, np.int64)
        self.gen = np.zeros(cap, np.int64)  # bumped whenever a slot is freed
        self.pos = np.full(cap, -1, np.int64)
        self.hash = np.zeros(cap, np.uint64)  # mixed window hash (see kernels)
        self.dup = np.zeros(cap, np.bool_)  # another unit has the same hash
        self.child = np.full(cap, -1, np.int64)  # the only slot naming this one's key as parent
        self.keys: list[Any] = [None] * cap
        self.parent_keys: list[Any] = [None] * cap
        self.holders: list[dict | None] = [None] * cap
        self.slot_of: dict[Hashable, int] = {}
        self.pending: dict[Hashable, dict] = {}  # key -> {holder: stores counted before its tokens}
        self.excluded: set = set()  # held keys that must never be found (see `add`)
        # parent key -> slots naming it as parent; tuples (usually of one), which the garbage
        # collector stops tracking, where a set per stored unit would be walked by every collection
        self.children: dict[Hashable, tuple[int, ...]] = {}
        self.free = list(range(cap - 1, -1, -1))
        self._new_table(2 * cap)
        self.stats = {"stored": 0, "removed": 0, "unknown_removals": 0, "requests": 0,
                      "rejected": 0, "prefix_tokens": 0, "reusable_tokens": 0, "probed_tokens": 0}

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.slot_of

    # ---- stores and removals ----
    def add(self, key: Hashable, tokens: Sequence[int] | None, parent: Hashable | None = None,
            holder: Hashable = None, position: int | None = None, exclude: bool = False) -> None:
        """A holder stored unit `key` (tokens; `parent`: the unit before it, None at the start of
        its sequence). Position: given, else the parent's + unit, 0 without parent, -1 unknown.
        tokens=None counts a store of `key` without its tokens (an event at another block size
        announcing the same hash): it keeps the unit held until that store is removed too.
        exclude=True: the unit must never be found (its KV depends on more than its tokens: an
        image, a LoRA adapter, a cache salt); it is counted like a tokenless store, and
        `excluded` names it while it is held so that its descendants can be excluded too."""
        self.stats["stored"] += 1
        slot = self.slot_of.get(key)
        if slot is not None:
            h = self.holders[slot]
            assert h is not None  # a held slot
            h[holder] = h.get(holder, 0) + 1
            return
        if exclude:
            self.excluded.add(key)
        if tokens is None or key in self.excluded:
            waiting = self.pending.setdefault(key, {})
            waiting[holder] = waiting.get(holder, 0) + 1
            return
        toks = as_tokens(tokens)
        if len(toks) != self.unit:
            raise ValueError(f"unit {key!r} has {len(toks)} tokens, the index's unit is {self.unit}")
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.unit_tokens[slot] = toks
        self.hash[slot] = unit_hash(toks, self.unit, self.base)
        self.keys[slot] = key
        self.parent_keys[slot] = parent
        held = self.pending.pop(key, {})
        held[holder] = held.get(holder, 0) + 1
        self.holders[slot] = held
        self.slot_of[key] = slot
        if parent is not None:
            self.children[parent] = self.children.get(parent, ()) + (slot,)
            self._set_child(parent)
        self._set_child(key)
        self._link(slot, parent)
        if position is not None:
            self.pos[slot] = position
        elif parent is None:
            self.pos[slot] = 0
        for child in self.children.get(key, ()):  # units stored before their parent
            self._link(child, key)
        if 2 * (len(self.slot_of) + 1) > len(self.tab):
            self._new_table(2 * len(self.tab))
        else:
            self._index(slot)

    def remove(self, key: Hashable, holder: Hashable = None) -> bool:
        """The holder dropped one store of `key`; the unit leaves with its last store."""
        slot = self.slot_of.get(key)
        h = self.holders[slot] if slot is not None else None
        if h is None or holder not in h:
            waiting = self.pending.get(key, {})
            n = waiting.get(holder, 0)
            if n:
                self.stats["removed"] += 1
                if n > 1:
                    waiting[holder] = n - 1
                else:
                    del waiting[holder]
                    if not waiting:
                        del self.pending[key]
                        self.excluded.discard(key)
            else:
                self.stats["unknown_removals"] += 1
            return False
        self.stats["removed"] += 1
        if h[holder] > 1:
            h[holder] -= 1
            return False
        del h[holder]
        if not h:
            assert slot is not None  # h is its holders
            self._drop(slot)
        return True

    def clear_holders(self, which: Callable[[Any], bool]) -> None:
        """Every holder for which which(holder) is true dropped everything (AllBlocksCleared)."""
        for slot in list(self.slot_of.values()):
            h = self.holders[slot]
            assert h is not None  # a held slot
            for holder in [x for x in h if which(x)]:
                del h[holder]
            if not h:
                self._drop(slot)
        for key, waiting in list(self.pending.items()):
            for holder in [x for x in waiting if which(x)]:
                del waiting[holder]
            if not waiting:
                del self.pending[key]
                self.excluded.discard(key)

    def _drop(self, slot: int) -> None:
        key, parent = self.keys[slot], self.parent_keys[slot]
        table_delete(self.tab, self.shift, self.hash[slot], slot, self.dup)
        filter_add(self.bits, self.bit_counts, self.fshift, self.hash[slot], -1)
        del self.slot_of[key]
        if parent is not None:
            kids = self.children.get(parent)
            if kids is not None:
                kids = tuple(c for c in kids if c != slot)
                if kids:
                    self.children[parent] = kids
                else:
                    del self.children[parent]
                self._set_child(parent)
        self.gen[slot] += 1  # children's links to this slot die with it
        self.parent[slot] = -1
        self.child[slot] = -1
        self.pos[slot] = -1
        self.keys[slot] = self.parent_keys[slot] = self.holders[slot] = None
        self.free.append(slot)

    def _set_child(self, key: Hashable) -> None:
        """child[slot of key] = the only slot naming key as parent, else -1 (see `_verify`)."""
        ps = self.slot_of.get(key)
        if ps is not None:
            kids = self.children.get(key)
            self.child[ps] = kids[0] if kids is not None and len(kids) == 1 else -1

    def _link(self, slot: int, parent: Hashable | None) -> None:
        ps = self.slot_of.get(parent) if parent is not None else None
        if ps is None:
            return
        self.parent[slot] = ps
        self.parent_gen[slot] = self.gen[ps]
        if self.pos[ps] >= 0:
            self._set_pos(slot, self.pos[ps] + self.unit)

    def _set_pos(self, slot: int, pos: int) -> None:
        todo = [(slot, pos)]
        while todo:
            s, p = todo.pop()
            if self.pos[s] == p:
                continue
            self.pos[s] = p
            todo.extend((c, p + self.unit) for c in self.children.get(self.keys[s], ()))

    def _grow(self) -> None:
        old = len(self.parent)
        new = 2 * old
        self.unit_tokens = np.concatenate([self.unit_tokens, np.zeros((old, self.unit), np.int64)])
        self.parent = np.concatenate([self.parent, np.full(old, -1, np.int64)])
        self.parent_gen = np.concatenate([self.parent_gen, np.zeros(old, np.int64)])
        self.gen = np.concatenate([self.gen, np.zeros(old, np.int64)])
        self.pos = np.concatenate([self.pos, np.full(old, -1, np.int64)])
        self.hash = np.concatenate([self.hash, np.zeros(old, np.uint64)])
        self.dup = np.concatenate([self.dup, np.zeros(old, np.bool_)])
        self.child = np.concatenate([self.child, np.full(old, -1, np.int64)])
        for lst in (self.keys, self.parent_keys, self.holders):
            lst.extend([None] * old)
        self.free.extend(range(new - 1, old - 1, -1))

    def _new_table(self, size: int) -> None:
        """Open-addressing table of `size` (a power of two) buckets and a filter of 8 * size
        bits, filled from the live slots."""
        self.tab = np.zeros((size, 2), np.uint64)
        self.dup[:] = False
        self.shift = 64 - (size.bit_length() - 1)
        self.bits = np.zeros(max(1, size // 8), np.uint64)
        self.bit_counts = np.zeros(64 * len(self.bits), np.int32)
        self.fshift = 64 - (len(self.bits).bit_length() - 1)
        for slot in self.slot_of.values():
            self._index(slot)

    def _index(self, slot: int) -> None:
        x = self.hash[slot]
        table_insert(self.tab, self.shift, x, slot, self.dup)
        filter_add(self.bits, self.bit_counts, self.fshift, x, 1)

    # ---- queries ----
    def find(self, tokens: Sequence[int] | np.ndarray) -> Match:
        """Every maximal run of consecutive stored units whose tokens occur in `tokens`."""
        t0 = time.perf_counter()
        toks = as_tokens(tokens)
        if len(toks) > len(self.inv_pow):
            self.inv_pow, self.mix_pow = power_tables(max(len(toks), 2 * len(self.inv_pow)),
                                                       self.unit, self.base, self.inverse)
        starts, order, scattered, ties, prefix, reusable, rejected = find_runs(
            toks, self.unit, self.inv_pow, self.mix_pow, self.bits, self.fshift, self.tab,
            self.shift, self.unit_tokens, self.hash, self.dup, self.child, self.parent,
            self.parent_gen, self.gen, self.pos)
        # Python objects only here, built by C loops (map, zip); a run's keys are one list slice
        # when its slots are consecutive (the usual case)
        keys = list(map(self.keys.__getitem__, order.tolist())) if scattered else self.keys
        new, old, length, at, end = starts.T.tolist() if len(starts) else ((),) * 5
        runs = list(map(tuple.__new__, repeat(Run),  # Run(...) is a Python-level constructor
                        zip(new, old, length, map(tuple, map(keys.__getitem__, map(slice, at, end))))))
        if ties:  # runs equal but for their keys: order them by the keys too
            runs.sort()
        m = Match(runs, prefix, reusable, rejected, time.perf_counter() - t0)
        st = self.stats
        st["requests"] += 1
        st["rejected"] += m.rejected
        st["prefix_tokens"] += prefix
        st["reusable_tokens"] += reusable
        st["probed_tokens"] += len(toks)
        return m

    def warm_up(self) -> None:
        """Load (or compile) the probe kernels now, so that no request's probe time includes it."""
        find_runs(np.zeros(0, np.int64), self.unit, self.inv_pow, self.mix_pow, self.bits, self.fshift,
              self.tab, self.shift, self.unit_tokens, self.hash, self.dup, self.child, self.parent,
              self.parent_gen, self.gen, self.pos)

    def units(self) -> dict:
        """Plain view {key: (tokens tuple, parent key, position)}, for `testing.subseq_reference.reference_find`."""
        return {k: (tuple(int(t) for t in self.unit_tokens[s]), self.parent_keys[s], int(self.pos[s]))
                for k, s in self.slot_of.items()}
