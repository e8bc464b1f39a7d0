"""Numba kernels of the sub-sequence index (`subseq_index.SubseqIndex`): window hashes, the
open-addressing table and the blocked Bloom filter, candidate verification and run building, one
call per request (`find_runs`). The plain-Python definitions the tests hold them to are in
`vllm_kvbm_plugin/testing/subseq_reference.py`."""

import numba
import numpy as np

DEFAULT_BASE = 0x9E3779B97F4A7C15 | 1  # odd, so every power of it is invertible mod 2**64
MIX = np.uint64(0xBF58476D1CE4E5B9)  # spreads the window hash's bits over buckets and filter bits

# The table and the filter hold each unit's *mixed* hash x = window hash * MIX (odd, so a
# bijection): its top bits pick the table bucket and the filter word, bits 20-31 the filter bits.
# A request's windows are hashed without a serial multiply chain: with R the prefix sums of
# t[j] * base**-j, window s's hash is (R[s+unit] - R[s]) * base**(unit-1+s), so every multiply
# but one add per token is independent (SIMD), and the mixed hash costs no extra multiply.

@numba.njit(cache=True, nogil=True)
def window_hashes(tokens: np.ndarray, unit: int, base: int) -> np.ndarray:
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
def unit_hash(tokens: np.ndarray, unit: int, base: int) -> np.uint64:
    """The mixed hash of one unit's tokens (what the table and the filter hold)."""
    return window_hashes(tokens, unit, base)[0] * MIX


@numba.njit(cache=True, nogil=True)
def power_tables(n: int, unit: int, base: int, inverse: int) -> tuple[np.ndarray, np.ndarray]:
    """inv_pow[j] = base**-j and mix_pow[s] = base**(unit-1+s) * MIX, for j, s < n."""
    inv_pow = np.empty(n, np.uint64)
    mix_pow = np.empty(n, np.uint64)
    b = np.uint64(base)
    c = np.uint64(inverse)
    p = np.uint64(1)
    for j in range(n):
        inv_pow[j] = p
        p = p * c
    p = MIX
    for _ in range(unit - 1):
        p = p * b
    for s in range(n):
        mix_pow[s] = p
        p = p * b
    return inv_pow, mix_pow


@numba.njit(cache=True, nogil=True)
def mixed_hashes(tokens: np.ndarray, unit: int, inv_pow: np.ndarray, mix_pow: np.ndarray) -> np.ndarray:
    """window_hashes(tokens) * MIX, from prefix sums (see above); len(tokens) <= len(inv_pow)."""
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
def table_insert(tab: np.ndarray, shift: int, x: np.uint64, slot: int, dup: np.ndarray) -> None:
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
def table_delete(tab: np.ndarray, shift: int, x: np.uint64, slot: int, dup: np.ndarray) -> bool:
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
    last = np.int64(-1)
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
def filter_add(bits: np.ndarray, counts: np.ndarray, fshift: int, x: np.uint64, delta: int) -> None:
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
    cand, cand_x = _candidates(mixed_hashes(tokens, unit, inv_pow, mix_pow), bits, fshift)
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
    and the request's (prefix tokens, reusable non-prefix tokens), see `subseq_index.Match`."""
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
def find_runs(tokens: np.ndarray, unit: int, inv_pow: np.ndarray, mix_pow: np.ndarray, bits: np.ndarray,
              fshift: int, tab: np.ndarray, shift: int, unit_tokens: np.ndarray, hashes: np.ndarray,
              dup: np.ndarray, child: np.ndarray, parent: np.ndarray, parent_gen: np.ndarray, gen: np.ndarray,
              pos: np.ndarray) -> tuple:
    """`SubseqIndex.find` in one call (each numba call costs ~10 us of argument unboxing)."""
    offs, slots, prev, depth, has_next, rejected = _probe(
        tokens, unit, inv_pow, mix_pow, bits, fshift, tab, shift, unit_tokens, hashes, dup, child,
        parent, parent_gen, gen)
    starts, order, scattered, ties, prefix, reusable = _runs(offs, slots, prev, depth, has_next,
                                                             unit, pos)
    return starts, order, scattered, ties, prefix, reusable, rejected
