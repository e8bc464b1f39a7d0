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

Kernels are numba (`window_hashes`, `_mixed_hashes`, `_candidates`, `_verify`, `_runs`, one
call per request: `_find`); `reference_find` and `reference_window_hashes` are the plain-Python
definitions the tests hold them to.
`feed_batch` builds the index from our KV event stream (BlockStored carries token ids).
"""

from __future__ import annotations

import array
import time
from collections.abc import Hashable, Iterable, Sequence
from itertools import repeat
from typing import Any, NamedTuple

import numba
import numpy as np

from vllm_kvbm_plugin.log import get_logger

logger = get_logger("reuse.subseq")

DEFAULT_BASE = 0x9E3779B97F4A7C15 | 1  # odd, so every power of it is invertible mod 2**64
_MIX = np.uint64(0xBF58476D1CE4E5B9)  # spreads the window hash's bits over buckets and filter bits
_M64 = (1 << 64) - 1
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
#
# The table and the filter hold each unit's *mixed* hash x = window hash * _MIX (odd, so a
# bijection): its top bits pick the table bucket and the filter word, bits 20-31 the filter bits.
# A request's windows are hashed without a serial multiply chain: with R the prefix sums of
# t[j] * base**-j, window s's hash is (R[s+unit] - R[s]) * base**(unit-1+s), so every multiply
# but one add per token is independent (SIMD), and the mixed hash costs no extra multiply.

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


@numba.njit(cache=True, nogil=True)
def _unit_hash(tokens, unit, base):
    """The mixed hash of one unit's tokens (what the table and the filter hold)."""
    return window_hashes(tokens, unit, base)[0] * _MIX


@numba.njit(cache=True, nogil=True)
def _power_tables(n, unit, base, inverse):
    """inv_pow[j] = base**-j and mix_pow[s] = base**(unit-1+s) * _MIX, for j, s < n."""
    inv_pow = np.empty(n, np.uint64)
    mix_pow = np.empty(n, np.uint64)
    b = np.uint64(base)
    c = np.uint64(inverse)
    p = np.uint64(1)
    for j in range(n):
        inv_pow[j] = p
        p = p * c
    p = _MIX
    for _ in range(unit - 1):
        p = p * b
    for s in range(n):
        mix_pow[s] = p
        p = p * b
    return inv_pow, mix_pow


@numba.njit(cache=True, nogil=True)
def _mixed_hashes(tokens, unit, inv_pow, mix_pow):
    """window_hashes(tokens) * _MIX, from prefix sums (see above); len(tokens) <= len(inv_pow)."""
    n = len(tokens)
    nw = n - unit + 1
    if nw <= 0:
        return np.empty(0, np.uint64)
    prefix = np.empty(n + 1, np.uint64)
    r = np.uint64(0)
    prefix[0] = r
    for j in range(n):
        r += np.uint64(tokens[j]) * inv_pow[j]
        prefix[j + 1] = r
    out = np.empty(nw, np.uint64)
    for s in range(nw):
        out[s] = (prefix[s + unit] - prefix[s]) * mix_pow[s]
    return out


@numba.njit(cache=True, nogil=True, inline="always")
def _bucket(x, shift):
    return np.int64(x >> np.uint64(shift))


@numba.njit(cache=True, nogil=True)
def _insert(tab, shift, x, slot, dup):
    """tab: uint64[size, 2] of (mixed hash, slot + 1), 0 = empty: one cache line per probe.
    dup[slot]: another unit has the same mixed hash (all of them lie between its home bucket and
    the next empty one)."""
    mask = len(tab) - 1
    i = _bucket(x, shift)
    while tab[i, 1] != 0:
        if tab[i, 0] == x:
            dup[slot] = True
            dup[np.int64(tab[i, 1]) - 1] = True
        i = (i + 1) & mask
    tab[i, 0] = x
    tab[i, 1] = np.uint64(slot + 1)


@numba.njit(cache=True, nogil=True)
def _delete(tab, shift, x, slot, dup):
    """Remove (x, slot) by backward shift: no tombstones, so probes stay as short as at insert."""
    mask = len(tab) - 1
    dup[slot] = False
    i = _bucket(x, shift)
    want = np.uint64(slot + 1)
    while tab[i, 1] != want:
        if tab[i, 1] == 0:
            return False
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if tab[j, 1] == 0:
            break
        home = _bucket(tab[j, 0], shift)
        # move j into the hole at i unless its home lies cyclically in (i, j]
        if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
            tab[i, 0] = tab[j, 0]
            tab[i, 1] = tab[j, 1]
            i = j
    tab[i, 1] = 0
    same = 0  # units left with this hash: one left is no longer a duplicate
    last = -1
    i = _bucket(x, shift)
    while tab[i, 1] != 0:
        if tab[i, 0] == x:
            same += 1
            last = np.int64(tab[i, 1]) - 1
        i = (i + 1) & mask
    if same == 1:
        dup[last] = False
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _filter_mask(x):
    """Blocked Bloom filter of the mixed hashes: word x >> fshift, these three bits of it."""
    return (np.uint64(1) << ((x >> np.uint64(20)) & np.uint64(63))) | \
        (np.uint64(1) << ((x >> np.uint64(26)) & np.uint64(63))) | \
        (np.uint64(1) << ((x >> np.uint64(32)) & np.uint64(63)))


@numba.njit(cache=True, nogil=True)
def _filter_add(bits, counts, fshift, x, delta):
    """Keep the filter exact under removals: a bit is set while its count is positive."""
    w = x >> np.uint64(fshift)
    mask = _filter_mask(x)
    for b in range(64):
        bit = np.uint64(1) << np.uint64(b)
        if mask & bit:
            counts[w * np.uint64(64) + np.uint64(b)] += delta
            if counts[w * np.uint64(64) + np.uint64(b)] > 0:
                bits[w] |= bit
            else:
                bits[w] &= ~bit


@numba.njit(cache=True, nogil=True)
def _candidates(xs, bits, fshift):
    """Offsets (and mixed hashes) of the windows the filter lets through. Tight loops, each
    simple enough to run at full speed (together 1.6x faster than one loop): read each window's
    filter word, test its bits into a byte per window (SIMD), read the bytes eight at a time
    (almost all zero)."""
    n = len(xs)
    fs = np.uint64(fshift)
    words = np.empty(n, np.uint64)
    for s in range(n):
        words[s] = bits[xs[s] >> fs]
    flags = np.zeros((n + 7) // 8 * 8, np.uint8)
    for s in range(n):
        want = _filter_mask(xs[s])
        flags[s] = (words[s] & want) == want
    words = flags.view(np.uint64)
    offs = np.empty(n + 8, np.int64)
    m = 0
    for k in range(len(words)):
        if words[k]:
            for s in range(8 * k, 8 * k + 8):
                offs[m] = s
                m += flags[s]
    offs = offs[:m]
    cand_x = np.empty(m, np.uint64)
    for c in range(m):
        cand_x[c] = xs[offs[c]]
    return offs, cand_x


@numba.njit(cache=True, nogil=True, inline="always")
def _same(a, b):
    """a == b for two int64 arrays of one length; no early exit, and on slices (not a 2-d index
    plus offset per token), so that it vectorises: 3x faster."""
    diff = np.int64(0)
    for k in range(len(a)):
        diff |= a[k] ^ b[k]
    return diff == 0


@numba.njit(cache=True, nogil=True)
def _verify(tokens, unit, cand, cand_x, tab, shift, unit_tokens, hashes, dup, child, parent,
            parent_gen, gen, offs, slots, prev, depth, has_next):
    """Table lookups and token checks of the candidate windows. Hits go to offs/slots in offset
    order, each linked to the hit one unit earlier holding its parent (prev, -1: a run starts
    here; depth: units in its run so far; has_next: a later hit continues it). Returns (hits,
    rejected), hits = -1 when offs is too small. Arrays are never reassigned in the loop: that
    alone makes it four times slower.
    Shortcut: a window one unit after a hit on unit p is first checked against p's only child
    (usually the next slot, in cache): when the child has the window's hash and no other unit has
    that hash, the child alone can hold the window, and the table is not read."""
    mask = len(tab) - 1
    lo = 0  # first hit at offset >= s - unit
    n = 0
    rejected = 0
    for c in range(len(cand)):
        s = cand[c]
        x = cand_x[c]
        while lo < n and offs[lo] < s - unit:
            lo += 1
        before = lo < n and offs[lo] == s - unit  # hits one unit earlier: lo, lo + 1, ...
        if before:
            p = slots[lo]
            y = child[p]
            if y >= 0 and hashes[y] == x and not dup[y] and parent[y] == p \
                    and parent_gen[y] == gen[p]:
                if not _same(unit_tokens[y], tokens[s:s + unit]):
                    rejected += 1
                elif n == len(offs):
                    return -1, rejected
                else:
                    offs[n] = s
                    slots[n] = y
                    prev[n] = lo
                    depth[n] = depth[lo] + 1
                    has_next[lo] = True
                    n += 1
                continue
        i = _bucket(x, shift)
        while tab[i, 1] != 0:
            if tab[i, 0] == x:
                slot = np.int64(tab[i, 1]) - 1
                if not _same(unit_tokens[slot], tokens[s:s + unit]):
                    rejected += 1
                elif n == len(offs):
                    return -1, rejected
                else:
                    offs[n] = s
                    slots[n] = slot
                    prev[n] = -1
                    depth[n] = 1
                    p = parent[slot]
                    if before and p >= 0 and gen[p] == parent_gen[slot]:
                        j = lo
                        while j < n and offs[j] == s - unit:
                            if slots[j] == p:
                                prev[n] = j
                                depth[n] = depth[j] + 1
                                has_next[j] = True
                                break
                            j += 1
                    n += 1
            i = (i + 1) & mask
    return n, rejected


@numba.njit(cache=True, nogil=True)
def _probe(tokens, unit, inv_pow, mix_pow, bits, fshift, tab, shift, unit_tokens, hashes, dup,
           child, parent, parent_gen, gen):
    """Verified hits (offset, slot, prev, depth, has_next: see `_verify`) in offset order, and
    the count of hash-only (rejected) hits. A filter of 3 bits in 16-32 per unit (cache-resident)
    turns away almost every window that no unit holds before it touches the table."""
    cand, cand_x = _candidates(_mixed_hashes(tokens, unit, inv_pow, mix_pow), bits, fshift)
    cap = len(cand) + 16
    while True:  # more hits than candidates only when several units hold the same tokens
        offs = np.empty(cap, np.int64)
        slots = np.empty(cap, np.int64)
        prev = np.empty(cap, np.int64)
        depth = np.empty(cap, np.int64)
        has_next = np.zeros(cap, np.bool_)
        n, rejected = _verify(tokens, unit, cand, cand_x, tab, shift, unit_tokens, hashes, dup,
                              child, parent, parent_gen, gen, offs, slots, prev, depth, has_next)
        if n >= 0:
            return offs[:n], slots[:n], prev[:n], depth[:n], has_next[:n], rejected
        cap *= 4


@numba.njit(cache=True, nogil=True, inline="always")
def _before(runs, a, b):
    """Sign of run a - run b by (new start, old start, length)."""
    for c in range(3):
        if runs[a, c] != runs[b, c]:
            return 1 if runs[a, c] > runs[b, c] else -1
    return 0


@numba.njit(cache=True, nogil=True)
def _runs(offs, slots, prev, depth, has_next, unit, pos):
    """Maximal runs from the hit links, sorted by (new start, old start, length): per run
    (new start, old start, length in tokens, first and end index into `order`), `order` = the
    runs' slots one after another; when every run's slots are consecutive (units stored in
    sequence take consecutive slots), the last two columns are slot ranges instead and
    `scattered` is False; whether two runs tie on all three (then only their keys order them);
    and the request's (prefix tokens, reusable non-prefix tokens), see `Match`."""
    n = len(offs)
    total = 0
    n_runs = 0
    for i in range(n):
        if not has_next[i]:
            n_runs += 1
            total += depth[i]
    found = np.empty((n_runs, 5), np.int64)
    order = np.empty(total, np.int64)
    r = 0
    at = 0
    prefix = 0
    for i in range(n):
        if has_next[i]:
            continue
        d = depth[i]
        j = i
        head = i
        for k in range(d - 1, -1, -1):
            order[at + k] = slots[j]
            head = j
            j = prev[j]
        new_start = offs[head]
        found[r, 0] = new_start
        found[r, 1] = pos[slots[head]]
        found[r, 2] = d * unit
        found[r, 3] = at
        found[r, 4] = at + d
        if new_start == 0 and found[r, 1] == 0 and d * unit > prefix:
            prefix = d * unit
        r += 1
        at += d
    starts = found  # runs end in offset order: usually start in it too
    for r in range(1, n_runs):
        if _before(found, r, r - 1) >= 0:
            continue
        # stable sorts, least significant first: (new start, old start, length)
        idx = np.argsort(found[:, 2], kind="mergesort")
        idx = idx[np.argsort(found[idx, 1], kind="mergesort")]
        idx = idx[np.argsort(found[idx, 0], kind="mergesort")]
        starts = np.empty_like(found)
        for q in range(n_runs):
            starts[q] = found[idx[q]]
        break
    ties = False
    for r in range(1, n_runs):
        if _before(starts, r, r - 1) == 0:
            ties = True
    scattered = False
    for r in range(n_runs):
        for i in range(starts[r, 3] + 1, starts[r, 4]):
            if order[i] != order[i - 1] + 1:
                scattered = True
    if not scattered:
        for r in range(n_runs):
            first = order[starts[r, 3]]
            starts[r, 4] = first + starts[r, 4] - starts[r, 3]
            starts[r, 3] = first
    reusable = 0
    end = prefix  # union of the runs past the prefix, in start order
    for r in range(n_runs):
        lo, hi = max(starts[r, 0], end), starts[r, 0] + starts[r, 2]
        if hi > lo:
            reusable += hi - lo
            end = hi
    return starts, order, scattered, ties, prefix, reusable


@numba.njit(cache=True, nogil=True)
def _find(tokens, unit, inv_pow, mix_pow, bits, fshift, tab, shift, unit_tokens, hashes, dup,
          child, parent, parent_gen, gen, pos):
    """`SubseqIndex.find` in one call (each numba call costs ~10 us of argument unboxing)."""
    offs, slots, prev, depth, has_next, rejected = _probe(
        tokens, unit, inv_pow, mix_pow, bits, fshift, tab, shift, unit_tokens, hashes, dup, child,
        parent, parent_gen, gen)
    starts, order, scattered, ties, prefix, reusable = _runs(offs, slots, prev, depth, has_next,
                                                             unit, pos)
    return starts, order, scattered, ties, prefix, reusable, rejected


# ---- the index -----------------------------------------------------------------------------------

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

    def __init__(self, unit: int, base: int = DEFAULT_BASE, capacity: int = 1024):
        if unit < 1:
            raise ValueError(f"unit must be >= 1, got {unit}")
        self.unit = unit
        if not base & 1:
            raise ValueError(f"base must be odd (invertible mod 2**64), got {base}")
        self.base = np.uint64(base & _M64)
        self.inverse = np.uint64(_inverse(base & _M64))
        self.inv_pow, self.mix_pow = _power_tables(0, unit, self.base, self.inverse)
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
        self.hash[slot] = _unit_hash(toks, self.unit, self.base)
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
        _delete(self.tab, self.shift, self.hash[slot], slot, self.dup)
        _filter_add(self.bits, self.bit_counts, self.fshift, self.hash[slot], -1)
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
        _insert(self.tab, self.shift, x, slot, self.dup)
        _filter_add(self.bits, self.bit_counts, self.fshift, x, 1)

    # ---- queries ----
    def find(self, tokens: Sequence[int] | np.ndarray) -> Match:
        """Every maximal run of consecutive stored units whose tokens occur in `tokens`."""
        t0 = time.perf_counter()
        toks = as_tokens(tokens)
        if len(toks) > len(self.inv_pow):
            self.inv_pow, self.mix_pow = _power_tables(max(len(toks), 2 * len(self.inv_pow)),
                                                       self.unit, self.base, self.inverse)
        starts, order, scattered, ties, prefix, reusable, rejected = _find(
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
        _find(np.zeros(0, np.int64), self.unit, self.inv_pow, self.mix_pow, self.bits, self.fshift,
              self.tab, self.shift, self.unit_tokens, self.hash, self.dup, self.child, self.parent,
              self.parent_gen, self.gen, self.pos)

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
