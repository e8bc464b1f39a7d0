"""Sub-sequence index: which stored hash units occur in a new request, at any offset.

Prefix caching serves a request only the stored blocks that start it. RAG and agent prompts repeat
the same documents at other positions and in other orders; their KV is stored under other keys
(block hashes chain the whole prefix) but their tokens are the same. This index finds them:

- It holds every stored hash unit: its tokens, its key (the block hash), its parent (the unit
  before it in its stored sequence) and its position there, with a store count per holder
  (worker, tier, group) so removals are exact: a unit leaves when its last holder removes it.
- A request is probed with a polynomial rolling hash over every window of `unit` tokens (every
  offset, not only unit boundaries). Each window hash is looked up in a compact open-addressing
  table (numpy arrays: hash, slot), and **every candidate is verified against the stored tokens**:
  a 64-bit polynomial hash can be collided on purpose, so the hash only proposes.
- Verified hits at offsets s and s + unit whose units are parent and child form a run; every
  maximal run is returned as `Run(new_start, old_start, length, keys)`.

Kernels are numba (`window_hashes`, `_probe`, `_chain_runs`); `reference_find` and
`reference_window_hashes` are the plain-Python definitions the tests hold them to.
`feed_batch` builds the index from our KV event stream (BlockStored carries token ids).
"""

from __future__ import annotations

import array
import time
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, NamedTuple

import numba
import numpy as np

from vllm_kvbm_plugin.log import get_logger

logger = get_logger("reuse.subseq")

DEFAULT_BASE = 0x9E3779B97F4A7C15 | 1  # odd, so every power of it is invertible mod 2**64
_MIX = np.uint64(0xBF58476D1CE4E5B9)  # spreads the window hash's high bits over table buckets
_MIX2 = np.uint64(0x94D049BB133111EB)  # picks the filter bits
_EMPTY = -1
# event groups whose blocks are not plain per-token KV (state checkpoints) or not all kept
_SKIP_KINDS = frozenset({"mamba", "sliding_window", "sliding_window_mla", "chunked_local_attention"})


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


# ---- kernels -------------------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True)
def window_hashes(tokens, unit, base):
    """uint64 hash of every window tokens[s:s+unit]: sum t[s+i] * base**(unit-1-i) mod 2**64."""
    n = len(tokens) - unit + 1
    if n <= 0:
        return np.empty(0, np.uint64)
    out = np.empty(n, np.uint64)
    b = np.uint64(base)
    top = np.uint64(1)  # base ** (unit - 1)
    for _ in range(unit - 1):
        top = top * b
    h = np.uint64(0)
    for i in range(unit):
        h = h * b + np.uint64(tokens[i])
    out[0] = h
    for s in range(1, n):
        h = (h - np.uint64(tokens[s - 1]) * top) * b + np.uint64(tokens[s + unit - 1])
        out[s] = h
    return out


@numba.njit(cache=True, nogil=True, inline="always")
def _bucket(h, shift):
    return np.int64((h * _MIX) >> np.uint64(shift))


@numba.njit(cache=True, nogil=True)
def _insert(tab_hash, tab_slot, shift, h, slot):
    mask = len(tab_slot) - 1
    i = _bucket(h, shift)
    while tab_slot[i] != -1:
        i = (i + 1) & mask
    tab_hash[i] = h
    tab_slot[i] = slot


@numba.njit(cache=True, nogil=True)
def _delete(tab_hash, tab_slot, shift, h, slot):
    """Remove (h, slot) by backward shift: no tombstones, so probes stay as short as at insert."""
    mask = len(tab_slot) - 1
    i = _bucket(h, shift)
    while tab_slot[i] != slot:
        if tab_slot[i] == -1:
            return False
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if tab_slot[j] == -1:
            break
        home = _bucket(tab_hash[j], shift)
        # move j into the hole at i unless its home lies cyclically in (i, j]
        if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
            tab_hash[i] = tab_hash[j]
            tab_slot[i] = tab_slot[j]
            i = j
    tab_slot[i] = -1
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _filter_word(h, fshift):
    """Blocked Bloom filter of the hashes: the word of h (all uint64: mixed int types are slow)."""
    return (h * _MIX) >> fshift


@numba.njit(cache=True, nogil=True, inline="always")
def _filter_mask(h):
    """The two bits of h in its word."""
    m = (h ^ (h >> np.uint64(29))) * _MIX2
    return (np.uint64(1) << (m >> np.uint64(58))) | (np.uint64(1) << ((m >> np.uint64(52)) & np.uint64(63)))


@numba.njit(cache=True, nogil=True)
def _filter_add(bits, counts, fshift, h, delta):
    """Keep the filter exact under removals: a bit is set while its count is positive."""
    w = _filter_word(h, np.uint64(fshift))
    mask = _filter_mask(h)
    for b in range(64):
        bit = np.uint64(1) << np.uint64(b)
        if mask & bit:
            counts[w * np.uint64(64) + np.uint64(b)] += delta
            if counts[w * np.uint64(64) + np.uint64(b)] > 0:
                bits[w] |= bit
            else:
                bits[w] &= ~bit


@numba.njit(cache=True, nogil=True)
def _filtered_windows(tokens, unit, base, bits, fshift):
    """Offsets and hashes of the windows the filter lets through (`window_hashes` on the fly).
    A tight loop of its own: table lookups in the same loop make it several times slower."""
    n = max(0, len(tokens) - unit + 1)
    offs = np.empty(n, np.int64)
    hashes = np.empty(n, np.uint64)
    m = 0
    b = np.uint64(base)
    fs = np.uint64(fshift)
    top = np.uint64(1)
    for _ in range(unit - 1):
        top = top * b
    h = np.uint64(0)
    for i in range(min(unit - 1, len(tokens))):
        h = h * b + np.uint64(tokens[i])
    for s in range(n):
        if s:
            h = h - np.uint64(tokens[s - 1]) * top
        h = h * b + np.uint64(tokens[s + unit - 1])
        want = _filter_mask(h)
        if bits[_filter_word(h, fs)] & want == want:
            offs[m] = s
            hashes[m] = h
            m += 1
    return offs[:m], hashes[:m]


@numba.njit(cache=True, nogil=True)
def _verify(tokens, unit, cand, cand_hash, tab_hash, tab_slot, shift, unit_tokens, offs, slots):
    """Table lookups and token checks of the candidate windows, hits written to offs/slots;
    returns (hits, rejected), hits = -1 when offs is too small. Arrays are never reassigned in
    the loop: that alone makes it four times slower."""
    mask = len(tab_slot) - 1
    n = 0
    rejected = 0
    for c in range(len(cand)):
        s = cand[c]
        h = cand_hash[c]
        i = _bucket(h, shift)
        while tab_slot[i] != -1:
            if tab_hash[i] == h:
                slot = tab_slot[i]
                same = True
                for k in range(unit):
                    if unit_tokens[slot, k] != tokens[s + k]:
                        same = False
                        break
                if not same:
                    rejected += 1
                elif n == len(offs):
                    return -1, rejected
                else:
                    offs[n] = s
                    slots[n] = slot
                    n += 1
            i = (i + 1) & mask
    return n, rejected


@numba.njit(cache=True, nogil=True)
def _probe(tokens, unit, base, tab_hash, tab_slot, shift, unit_tokens, bits, fshift):
    """Verified hits (offset, slot) in offset order, and the count of hash-only (rejected) hits.
    A filter of 2 bits in 16-32 per unit (cache-resident) turns away almost every window that no
    unit holds before it touches the table."""
    cand, cand_hash = _filtered_windows(tokens, unit, base, bits, fshift)
    cap = len(cand) + 16
    while True:  # more hits than candidates only when several units hold the same tokens
        offs = np.empty(cap, np.int64)
        slots = np.empty(cap, np.int64)
        n, rejected = _verify(tokens, unit, cand, cand_hash, tab_hash, tab_slot, shift,
                              unit_tokens, offs, slots)
        if n >= 0:
            return offs[:n], slots[:n], rejected
        cap *= 4


@numba.njit(cache=True, nogil=True)
def _chain_runs(offs, slots, unit, parent, parent_gen, gen):
    """Link each hit to the hit one unit earlier holding its parent; return per hit its previous
    hit (-1: a run starts here) and whether a later hit continues it (False: a run ends here)."""
    n = len(offs)
    prev = np.full(n, -1, np.int64)
    has_next = np.zeros(n, np.bool_)
    lo = 0  # first hit at offset offs[i] - unit
    for i in range(n):
        want = offs[i] - unit
        while lo < n and offs[lo] < want:
            lo += 1
        p = parent[slots[i]]
        if p < 0 or gen[p] != parent_gen[slots[i]]:
            continue
        j = lo
        while j < n and offs[j] == want:
            if slots[j] == p:
                prev[i] = j
                has_next[j] = True
                break
            j += 1
    return prev, has_next


@numba.njit(cache=True, nogil=True)
def _runs(offs, slots, prev, has_next, unit, pos, n_tokens):
    """Maximal runs from the hit links: per run (new start, old start, length in units, first
    index into `order`), `order` = the runs' slots one after another; and the request's
    (prefix tokens, reusable non-prefix tokens), see `Match`."""
    n = len(offs)
    depth = np.zeros(n, np.int64)
    total = 0
    n_runs = 0
    for i in range(n):  # prev[i] < i: hits are in offset order
        depth[i] = 1 if prev[i] < 0 else depth[prev[i]] + 1
        if not has_next[i]:
            n_runs += 1
            total += depth[i]
    starts = np.empty((n_runs, 4), np.int64)
    order = np.empty(total, np.int64)
    r = 0
    at = 0
    prefix = 0
    for i in range(n):
        if has_next[i]:
            continue
        d = depth[i]
        j = i
        for k in range(d - 1, -1, -1):
            order[at + k] = slots[j]
            head = j
            j = prev[j]
        new_start = offs[head]
        starts[r, 0] = new_start
        starts[r, 1] = pos[slots[head]]
        starts[r, 2] = d
        starts[r, 3] = at
        if new_start == 0 and starts[r, 1] == 0 and d * unit > prefix:
            prefix = d * unit
        r += 1
        at += d
    reusable = 0
    end = prefix  # union of the runs past the prefix, in start order
    for r in np.argsort(starts[:, 0]):
        lo, hi = max(starts[r, 0], end), starts[r, 0] + starts[r, 2] * unit
        if hi > lo:
            reusable += hi - lo
            end = hi
    return starts, order, prefix, reusable


@numba.njit(cache=True, nogil=True)
def _find(tokens, unit, base, tab_hash, tab_slot, shift, unit_tokens, bits, fshift, parent,
          parent_gen, gen, pos):
    """`SubseqIndex.find` in one call (each numba call costs ~10 us of argument unboxing)."""
    offs, slots, rejected = _probe(tokens, unit, base, tab_hash, tab_slot, shift, unit_tokens,
                                   bits, fshift)
    prev, has_next = _chain_runs(offs, slots, unit, parent, parent_gen, gen)
    starts, order, prefix, reusable = _runs(offs, slots, prev, has_next, unit, pos, len(tokens))
    return starts, order, prefix, reusable, rejected


# ---- the index -----------------------------------------------------------------------------------

def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False)
    return np.frombuffer(array.array("q", tokens), dtype=np.int64)


class SubseqIndex:
    """Stored hash units of `unit` tokens, findable at any offset of a request (module doc)."""

    def __init__(self, unit: int, base: int = DEFAULT_BASE, capacity: int = 1024):
        if unit < 1:
            raise ValueError(f"unit must be >= 1, got {unit}")
        self.unit = unit
        self.base = np.uint64(base & 0xFFFFFFFFFFFFFFFF)
        cap = 1 << max(4, (capacity - 1).bit_length())
        self.unit_tokens = np.zeros((cap, unit), np.int64)
        self.parent = np.full(cap, -1, np.int64)  # parent's slot, valid while gen matches
        self.parent_gen = np.zeros(cap, np.int64)
        self.gen = np.zeros(cap, np.int64)  # bumped whenever a slot is freed
        self.pos = np.full(cap, -1, np.int64)
        self.hash = np.zeros(cap, np.uint64)
        self.keys: list[Any] = [None] * cap
        self.parent_keys: list[Any] = [None] * cap
        self.holders: list[dict | None] = [None] * cap
        self.slot_of: dict[Hashable, int] = {}
        self.pending: dict[Hashable, dict] = {}  # key -> {holder: stores counted before its tokens}
        self.excluded: set = set()  # held keys that must never be found (see `add`)
        self.children: dict[Hashable, set[int]] = {}  # parent key -> slots naming it as parent
        self.free = list(range(cap - 1, -1, -1))
        self._new_table(2 * cap)
        self.stats = {"stored": 0, "removed": 0, "unknown_removals": 0, "requests": 0,
                      "rejected": 0, "prefix_tokens": 0, "reusable_tokens": 0, "probed_tokens": 0}

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, key) -> bool:
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
        h = window_hashes(toks, self.unit, self.base)[0]
        self.hash[slot] = h
        self.keys[slot] = key
        self.parent_keys[slot] = parent
        held = self.pending.pop(key, {})
        held[holder] = held.get(holder, 0) + 1
        self.holders[slot] = held
        self.slot_of[key] = slot
        if parent is not None:
            self.children.setdefault(parent, set()).add(slot)
        self._link(slot, parent)
        if position is not None:
            self.pos[slot] = position
        elif parent is None:
            self.pos[slot] = 0
        for child in self.children.get(key, ()):  # units stored before their parent
            self._link(child, key)
        if 2 * (len(self.slot_of) + 1) > len(self.tab_slot):
            self._new_table(2 * len(self.tab_slot))
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
            self._drop(slot)
        return True

    def clear_holders(self, which) -> None:
        """Every holder for which which(holder) is true dropped everything (AllBlocksCleared)."""
        for slot in list(self.slot_of.values()):
            h = self.holders[slot]
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
        _delete(self.tab_hash, self.tab_slot, self.shift, self.hash[slot], slot)
        _filter_add(self.bits, self.bit_counts, self.fshift, self.hash[slot], -1)
        del self.slot_of[key]
        if parent is not None:
            kids = self.children.get(parent)
            if kids is not None:
                kids.discard(slot)
                if not kids:
                    del self.children[parent]
        self.gen[slot] += 1  # children's links to this slot die with it
        self.parent[slot] = -1
        self.pos[slot] = -1
        self.keys[slot] = self.parent_keys[slot] = self.holders[slot] = None
        self.free.append(slot)

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
        for lst in (self.keys, self.parent_keys, self.holders):
            lst.extend([None] * old)
        self.free.extend(range(new - 1, old - 1, -1))

    def _new_table(self, size: int) -> None:
        """Open-addressing table of `size` (a power of two) buckets and a filter of 8 * size
        bits, filled from the live slots."""
        self.tab_hash = np.zeros(size, np.uint64)
        self.tab_slot = np.full(size, _EMPTY, np.int64)
        self.shift = 64 - (size.bit_length() - 1)
        self.bits = np.zeros(max(1, size // 8), np.uint64)
        self.bit_counts = np.zeros(64 * len(self.bits), np.int32)
        self.fshift = 64 - (len(self.bits).bit_length() - 1)
        for slot in self.slot_of.values():
            self._index(slot)

    def _index(self, slot: int) -> None:
        h = self.hash[slot]
        _insert(self.tab_hash, self.tab_slot, self.shift, h, slot)
        _filter_add(self.bits, self.bit_counts, self.fshift, h, 1)

    # ---- queries ----
    def find(self, tokens: Sequence[int] | np.ndarray) -> Match:
        """Every maximal run of consecutive stored units whose tokens occur in `tokens`."""
        t0 = time.perf_counter()
        toks = as_tokens(tokens)
        starts, order, prefix, reusable, rejected = _find(
            toks, self.unit, self.base, self.tab_hash, self.tab_slot, self.shift, self.unit_tokens,
            self.bits, self.fshift, self.parent, self.parent_gen, self.gen, self.pos)
        unit, all_keys = self.unit, self.keys
        keys = list(map(all_keys.__getitem__, order.tolist()))
        new_run = tuple.__new__  # Run(...) is a Python-level constructor: 3x slower
        runs = [new_run(Run, (new, old, d * unit, tuple(keys[at:at + d])))
                for new, old, d, at in starts.tolist()]
        runs.sort()
        m = Match(runs, int(prefix), int(reusable), int(rejected), time.perf_counter() - t0)
        st = self.stats
        st["requests"] += 1
        st["rejected"] += m.rejected
        st["prefix_tokens"] += prefix
        st["reusable_tokens"] += reusable
        st["probed_tokens"] += len(toks)
        return m

    def warm_up(self) -> None:
        """Load (or compile) the probe kernels now, so that no request's probe time includes it."""
        _find(np.zeros(0, np.int64), self.unit, self.base, self.tab_hash, self.tab_slot, self.shift,
              self.unit_tokens, self.bits, self.fshift, self.parent, self.parent_gen, self.gen, self.pos)

    def units(self) -> dict:
        """Plain view {key: (tokens tuple, parent key, position)}, for `reference_find`."""
        return {k: (tuple(int(t) for t in self.unit_tokens[s]), self.parent_keys[s], int(self.pos[s]))
                for k, s in self.slot_of.items()}


def coverage(runs: Iterable[Run], n: int) -> tuple[int, int]:
    """(prefix tokens, reusable non-prefix tokens) of a request of n tokens (see `Match`), by
    marking covered tokens: the plain-Python definition `_runs` is tested against."""
    runs = list(runs)
    prefix = max((r.length for r in runs if r.new_start == 0 and r.old_start == 0), default=0)
    covered = np.zeros(n, np.bool_)
    for r in runs:
        covered[r.new_start:r.new_start + r.length] = True
    return prefix, int(covered[prefix:].sum())


# ---- plain-Python definitions (the kernels' reference) -------------------------------------------

def reference_window_hashes(tokens: Sequence[int], unit: int, base: int = DEFAULT_BASE) -> list[int]:
    m = 1 << 64
    return [sum((t % m) * pow(base, unit - 1 - i, m) for i, t in enumerate(tokens[s:s + unit])) % m
            for s in range(len(tokens) - unit + 1)]


def reference_find(units: dict, tokens: Sequence[int], unit: int) -> list[Run]:
    """`SubseqIndex.find`'s runs by brute force over `units` {key: (tokens, parent key, position)}:
    compare tokens directly at every offset, chain parent -> child hits, keep the maximal runs."""
    by_tokens: dict[tuple, list] = {}
    for key, (toks, _, _) in units.items():
        by_tokens.setdefault(tuple(toks), []).append(key)
    hits = {}  # (offset, key) -> run of keys ending here
    for s in range(len(tokens) - unit + 1):
        for key in by_tokens.get(tuple(tokens[s:s + unit]), ()):
            parent = units[key][1]
            before = hits.get((s - unit, parent)) if parent in units else None
            hits[(s, key)] = (before or []) + [key]
    continued = {(s - unit, units[k][1]) for (s, k) in hits if units[k][1] in units}
    runs = []
    for (s, key), chain in hits.items():
        if (s, key) in continued:
            continue
        start = s - (len(chain) - 1) * unit
        runs.append(Run(start, units[chain[0]][2], len(chain) * unit, tuple(chain)))
    return sorted(runs)


# ---- from the KV event stream --------------------------------------------------------------------

def event_unit(batches: Iterable) -> int | None:
    """The hash unit of a recorded stream: the smallest block size of a BlockStored with tokens
    (hybrid models also announce coarse blocks; per-unit events are the smaller ones)."""
    from vllm_kvbm_plugin.events.types import BlockStored

    unit = None
    for batch in batches:
        for ev in batch.events:
            if (isinstance(ev, BlockStored) and ev.token_ids and ev.block_hashes
                    and ev.kv_cache_spec_kind not in _SKIP_KINDS):
                unit = ev.block_size if unit is None else min(unit, ev.block_size)
    return unit


def feed_batch(index: SubseqIndex, batch, worker: Hashable = None, lora_name: str | None = None) -> None:
    """Apply one KVEventBatch: units are keyed by block hash, held per (worker, dp rank, tier,
    group). Events of state/windowed groups are skipped; events of another block size than the
    index's unit only count stores of their hashes. Units whose KV depends on more than their
    tokens are held but never found: units with extra keys (images, the cache salt vLLM folds
    into a request's first block), every unit after one of those in its sequence, and units of
    another LoRA adapter than `lora_name`."""
    from vllm_kvbm_plugin.events.types import (
        MEDIUM_GPU,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        tier_of,
    )

    dp = batch.data_parallel_rank
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            if ev.kv_cache_spec_kind in _SKIP_KINDS:
                continue
            holder = (worker, dp, tier_of(ev), ev.group_idx)
            parent = ev.parent_block_hash
            unit = index.unit if ev.block_size == index.unit else 0
            other_lora = ev.lora_name != lora_name or (lora_name is None and ev.lora_id is not None)
            extra = ev.extra_keys or ()
            for i, h in enumerate(ev.block_hashes):
                toks = ev.token_ids[i * unit:(i + 1) * unit] if unit else None
                exclude = (other_lora or (i < len(extra) and extra[i] is not None)
                           or parent in index.excluded)
                index.add(h, toks if toks is not None and len(toks) == unit else None, parent, holder,
                          exclude=exclude)
                parent = h
        elif isinstance(ev, BlockRemoved):
            holder = (worker, dp, tier_of(ev), ev.group_idx)
            for h in ev.block_hashes:
                index.remove(h, holder)
        elif isinstance(ev, AllBlocksCleared):
            index.clear_holders(lambda x: x[0] == worker and x[1] == dp and x[2].medium == MEDIUM_GPU)


def match_recording(fp, prompts: Iterable[Sequence[int]], unit: int | None = None) -> Iterable[dict]:
    """`vllm-kvbm match`: build the index from a recorded stream (JSON lines), then one JSON-ready
    dict per prompt (runs and metrics), and last {"index": stats}."""
    from vllm_kvbm_plugin.events import recording

    batches = [b for _, b in recording.read(fp)]
    unit = unit or event_unit(batches)
    if unit is None:
        raise ValueError("the recording has no BlockStored event with token ids: no unit to index")
    index = SubseqIndex(unit)
    for batch in batches:
        feed_batch(index, batch)
    index.warm_up()
    for tokens in prompts:
        m = index.find(tokens)
        yield {"prompt_tokens": len(tokens), "prefix_tokens": m.prefix_tokens,
               "reusable_tokens": m.reusable_tokens, "rejected": m.rejected,
               "probe_us": round(m.seconds * 1e6, 1),
               "runs": [{"new_start": r.new_start, "old_start": r.old_start, "length": r.length,
                         "keys": [k.hex() if isinstance(k, bytes) else k for k in r.keys]}
                        for r in m.runs]}
    yield {"index": {"unit": unit, "units": len(index), **index.stats}}
