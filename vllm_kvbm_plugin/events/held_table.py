"""The router index's table of held hashes (events/index.py), in numba: no Python object per hash.

Two open-addressing tables (linear probing, deletion by backward shift, so no tombstones), each a
numpy array of rows (key, tag, values; tag 0: an empty row), one cache line or so per probe:
- `held`: hash -> holder bits, in words of 64 (a holder is a (worker, tier, group); bit i of word
  i // 64). A hash is in it while some holder holds it.
- `extra`: (hash, holder) -> store count beyond the first, for the hashes a holder was announced
  more than once (the plugin's coarse and unit events announce one hash at two block sizes).

Hashes are keys of 64 bits: vLLM's int form of a block hash (the digest's last 8 bytes, big
endian); a digest carried as bytes is keyed by the same 8 bytes (`hash_keys`), so a prompt hashed
either way finds it. Stores and removals come as runs of hashes (one per event), many events'
worth applied in order by one kernel call (`apply`).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numba
import numpy as np

STORE, REMOVE = 1, 0
_MASK64 = (1 << 64) - 1
_MIN_CAPACITY = 1 << 12
_GROUP = 16  # hashes whose rows are loaded together (_warm)
_LOAD = 0.5  # grow a table past this fill


def hash_keys(hashes: Sequence) -> np.ndarray:
    """Event hashes (ints, or digests as bytes) as uint64 keys."""
    try:
        return np.frombuffer(array.array("Q", hashes), np.uint64)
    except (TypeError, OverflowError):
        return np.array([hash_key(h) for h in hashes], np.uint64)


def hash_key(h: int | bytes) -> int:
    """One event hash as its 64-bit key: an int's low 64 bits, a digest's last 8 bytes."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h)[-8:], "big")
    return int(h) & _MASK64


@numba.njit(cache=True, nogil=True, inline="always")
def _slot(k0, tag, mask):
    x = k0 ^ (tag * np.uint64(0x9E3779B97F4A7C15))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return np.int64(x & mask)


@numba.njit(cache=True, nogil=True, inline="always")
def _find(rows, k0, tag):
    """Row of (k0, tag), or -(empty row) - 1 where it would go. A row: k0, tag (0: empty), values."""
    m = len(rows) - 1
    i = _slot(k0, tag, np.uint64(m))
    while rows[i, 1]:
        if rows[i, 0] == k0 and rows[i, 1] == tag:
            return i
        i = (i + 1) & m
    return -i - 1


@numba.njit(cache=True, nogil=True, inline="always")
def _warm(rows, hashes, start, tag):
    """Load the home rows of hashes[start:start + _GROUP] at once: their cache misses overlap,
    where a probe at a time waits for each. Returns a value to keep (the loads are not dropped)."""
    m = np.uint64(len(rows) - 1)
    acc = np.uint64(0)
    for u in range(start, min(start + _GROUP, len(hashes))):
        acc ^= rows[_slot(hashes[u], tag, m), 1]
    return acc


@numba.njit(cache=True, nogil=True)
def _delete(rows, i):
    """Empty row i, shifting back the rows of its probe run that may not stay behind a hole."""
    m = len(rows) - 1
    j = i
    while True:
        rows[i, 1] = 0
        while True:
            j = (j + 1) & m
            if not rows[j, 1]:
                return
            k = _slot(rows[j, 0], rows[j, 1], np.uint64(m))
            if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
                continue  # its home lies between the hole and it: it stays
            break
        rows[i, :] = rows[j, :]
        i = j


@numba.njit(cache=True, nogil=True, inline="always")
def _empty(row):
    for w in range(2, len(row)):
        if row[w]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _apply(held, hn, extra, xn, hashes, ends, holders, ops, pos, h_limit, x_limit, stats):
    """Stores and removals of `hashes[pos:]` (run s: hashes up to ends[s], holder holders[s],
    ops[s] STORE or REMOVE), until done or a table reaches its limit; returns where it stopped.
    stats[0]: removals of hashes the holder did not hold; stats[1]: a sink for `_warm`."""
    s = 0
    n = len(hashes)
    one = np.uint64(1)
    warm = np.uint64(0)
    while pos < n:
        while ends[s] <= pos:
            s += 1
        if hn[0] >= h_limit or xn[0] >= x_limit:
            break
        if pos % _GROUP == 0:
            warm ^= _warm(held, hashes, pos, one)
        h = hashes[pos]
        hid = holders[s]
        w = 2 + hid // 64
        bit = one << np.uint64(hid % 64)
        tag = np.uint64(hid) + one
        i = _find(held, h, one)
        if ops[s] == 1:
            if i < 0:
                i = -i - 1
                for c in range(2, held.shape[1]):
                    held[i, c] = 0
                held[i, 0], held[i, 1] = h, one
                held[i, w] = bit
                hn[0] += 1
            elif held[i, w] & bit:
                x = _find(extra, h, tag)
                if x < 0:
                    x = -x - 1
                    extra[x, 0], extra[x, 1], extra[x, 2] = h, tag, one
                    xn[0] += 1
                else:
                    extra[x, 2] += one
            else:
                held[i, w] |= bit
        elif i < 0 or not held[i, w] & bit:
            stats[0] += 1
        else:
            x = _find(extra, h, tag) if xn[0] else -1
            if x >= 0:
                extra[x, 2] -= one
                if extra[x, 2] == 0:
                    _delete(extra, x)
                    xn[0] -= 1
            else:
                held[i, w] &= ~bit
                if _empty(held[i]):
                    _delete(held, i)
                    hn[0] -= 1
        pos += 1
    stats[1] ^= np.int64(warm & np.uint64(1))
    return pos


@numba.njit(cache=True, nogil=True)
def _clear(held, hn, extra, xn, hid):
    """Drop every hash of holder `hid`."""
    w = 2 + hid // 64
    bit = np.uint64(1) << np.uint64(hid % 64)
    i = 0
    while i < len(held):  # a deletion shifts a later row back into i: look at i again
        if held[i, 1] and held[i, w] & bit:
            held[i, w] &= ~bit
            if _empty(held[i]):
                _delete(held, i)
                hn[0] -= 1
                continue
        i += 1
    i = 0
    tag = np.uint64(hid) + np.uint64(1)
    while i < len(extra):
        if extra[i, 1] == tag:
            _delete(extra, i)
            xn[0] -= 1
            continue
        i += 1


@numba.njit(cache=True, nogil=True)
def _held(held, bits, out):
    """Keys of the rows holding any of `bits`; returns how many were written to out."""
    n = 0
    for i in range(len(held)):
        if held[i, 1]:
            for w in range(len(bits)):
                if held[i, 2 + w] & bits[w]:
                    out[n] = held[i, 0]
                    n += 1
                    break
    return n


@numba.njit(cache=True, nogil=True)
def _lookup(held, hashes, out, start, zeros, run, stats):
    """Holder bits of `hashes` into out[start:]; stops after `run` consecutive units nobody
    holds (counting `zeros` already seen). Returns the zeros run at the end."""
    one = np.uint64(1)
    warm = np.uint64(0)
    for u in range(len(hashes)):
        if u % _GROUP == 0:
            warm ^= _warm(held, hashes, u, one)
        i = _find(held, hashes[u], one)
        if i >= 0:
            out[start + u, :] = held[i, 2:]
            zeros = 0
        else:
            zeros += 1
            if zeros >= run:
                break
    stats[1] ^= np.int64(warm & np.uint64(1))
    return zeros


@numba.njit(cache=True, nogil=True)
def _rehash(old, new):
    for i in range(len(old)):
        if old[i, 1]:
            j = -_find(new, old[i, 0], old[i, 1]) - 1
            new[j, :old.shape[1]] = old[i, :]


class _Table:
    """One open-addressing table: rows of (key, tag, values), tag 0 for an empty row; its size."""

    def __init__(self, width: int, capacity: int = _MIN_CAPACITY):
        self.rows = np.zeros((capacity, 2 + width), np.uint64)
        self.n = np.zeros(1, np.int64)

    @property
    def limit(self) -> int:
        return int(len(self.rows) * _LOAD)

    def resize(self, capacity: int, width: int) -> None:
        rows = np.zeros((capacity, 2 + width), np.uint64)
        _rehash(self.rows, rows)
        self.rows = rows

    def grow(self) -> None:
        self.resize(len(self.rows) * 2, self.rows.shape[1] - 2)


class HeldTable:
    """Which holders hold each hash, with store counts (module docstring). Holders are numbered
    from 0 by the index; `words` grows as they pass multiples of 64."""

    def __init__(self) -> None:
        self.words = 1
        self.held = _Table(1)
        self.extra = _Table(1)
        self._stats = np.zeros(2, np.int64)  # removals of hashes not held; a sink (_warm)

    def __len__(self) -> int:
        return int(self.held.n[0])

    @property
    def unknown_removals(self) -> int:
        """Removals of hashes their holder did not hold (so far)."""
        return int(self._stats[0])

    def add_holder(self, hid: int) -> None:
        """Make room for holder `hid`'s bit."""
        if hid // 64 + 1 > self.words:
            self.words = hid // 64 + 1
            self.held.resize(len(self.held.rows), self.words)

    def apply(self, hashes: np.ndarray, ends: np.ndarray, holders: np.ndarray, ops: np.ndarray) -> None:
        """Runs of stores and removals, in order: run s is hashes[ends[s-1]:ends[s]] of holder
        holders[s], ops[s] STORE or REMOVE."""
        pos = 0
        held, extra = self.held, self.extra
        while True:
            pos = _apply(held.rows, held.n, extra.rows, extra.n, hashes, ends, holders, ops, pos,
                         held.limit, extra.limit, self._stats)
            if pos >= len(hashes):
                return
            if held.n[0] >= held.limit:
                held.grow()
            if extra.n[0] >= extra.limit:
                extra.grow()

    def clear(self, hid: int) -> None:
        """Forget every hash of holder `hid`."""
        held, extra = self.held, self.extra
        _clear(held.rows, held.n, extra.rows, extra.n, hid)

    def held_by(self, holder_ids: Sequence[int]) -> set[int]:
        """The keys any of `holder_ids` holds (a scan: for tests and inspection)."""
        bits = self.bits(holder_ids)
        out = np.empty(len(self), np.uint64)
        n = _held(self.held.rows, bits, out)
        return set(out[:n].tolist())

    def bits(self, holder_ids: Sequence[int]) -> np.ndarray:
        """The holders' bits as words."""
        out = np.zeros(self.words, np.uint64)
        for hid in holder_ids:
            out[hid // 64] |= np.uint64(1 << (hid % 64))
        return out

    def lookup(self, keys: np.ndarray, out: np.ndarray, start: int = 0, zeros: int = 0, run: int = 1 << 62) -> int:
        """Holder bits of `keys` into out[start:] (rows of `words`, zeroed by the caller); stops
        after `run` consecutive units nobody holds. Returns the zeros run at the end."""
        return _lookup(self.held.rows, keys, out, start, zeros, run, self._stats)
