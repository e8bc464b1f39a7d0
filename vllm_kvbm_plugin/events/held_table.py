"""The router index's table of held hashes (events/index.py), in numba: no Python object per hash.

Two open-addressing tables (linear probing, deletion by backward shift, so no tombstones):
- `held`: hash -> holder bits, in words of 64 (a holder is a (worker, tier, group); bit i of word
  i // 64). A hash is in it while some holder holds it.
- `extra`: (hash, holder) -> store count beyond the first, for the hashes a holder was announced
  more than once (the plugin's coarse and unit events announce one hash at two block sizes).

Hashes are keys of 64 bits: vLLM's int form of a block hash (the digest's last 8 bytes, big
endian); a digest carried as bytes is keyed by the same 8 bytes (`hash_keys`), so a prompt hashed
either way finds it. A batch's stores and removals are one kernel call (`apply`): a run of
hashes per event, in order.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numba
import numpy as np

STORE, REMOVE = 1, 0
_MASK64 = (1 << 64) - 1
_MIN_CAPACITY = 1 << 12
_LOAD = 0.5  # grow a table past this fill


def hash_keys(hashes: Sequence) -> np.ndarray:
    """Event hashes (ints, or digests as bytes) as uint64 keys."""
    try:
        return np.frombuffer(array.array("Q", hashes), np.uint64)
    except (TypeError, OverflowError):
        return np.array([hash_key(h) for h in hashes], np.uint64)


def hash_key(h) -> int:
    """One event hash as its 64-bit key: an int's low 64 bits, a digest's last 8 bytes."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h)[-8:], "big")
    return int(h) & _MASK64


@numba.njit(cache=True, nogil=True, inline="always")
def _slot(k0, k1, mask):
    x = k0 ^ (k1 * np.uint64(0x9E3779B97F4A7C15))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return np.int64(x & mask)


@numba.njit(cache=True, nogil=True)
def _find(keys, used, k0, k1):
    """Row of (k0, k1), or -(empty row) - 1 where it would go."""
    m = np.uint64(len(used) - 1)
    i = _slot(k0, k1, m)
    while used[i]:
        if keys[i, 0] == k0 and keys[i, 1] == k1:
            return i
        i = (i + 1) & np.int64(m)
    return -i - 1


@numba.njit(cache=True, nogil=True)
def _delete(keys, used, vals, i):
    """Empty row i, shifting back the rows of its probe run that may not stay behind a hole."""
    m = np.int64(len(used) - 1)
    j = i
    while True:
        used[i] = 0
        while True:
            j = (j + 1) & m
            if not used[j]:
                return
            k = _slot(keys[j, 0], keys[j, 1], np.uint64(m))
            if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
                continue  # its home lies between the hole and it: it stays
            break
        keys[i, 0], keys[i, 1] = keys[j, 0], keys[j, 1]
        vals[i, :] = vals[j, :]
        used[i] = 1
        i = j


@numba.njit(cache=True, nogil=True)
def _apply(hk, hu, hv, hn, xk, xu, xv, xn, hashes, ends, holders, ops, pos, h_limit, x_limit, stats):
    """Stores and removals of `hashes[pos:]` (run s: hashes up to ends[s], holder holders[s],
    ops[s] STORE or REMOVE), until done or a table reaches its limit; returns where it stopped.
    stats[0]: removals of hashes the holder did not hold."""
    s = 0
    n = len(hashes)
    while pos < n:
        while ends[s] <= pos:
            s += 1
        if hn[0] >= h_limit or xn[0] >= x_limit:
            return pos
        h = hashes[pos]
        hid = holders[s]
        w = hid // 64
        bit = np.uint64(1) << np.uint64(hid % 64)
        i = _find(hk, hu, h, np.uint64(0))
        if ops[s] == 1:
            if i < 0:
                i = -i - 1
                hk[i, 0], hk[i, 1] = h, np.uint64(0)
                hv[i, :] = 0
                hv[i, w] = bit
                hu[i] = 1
                hn[0] += 1
            elif hv[i, w] & bit:
                x = _find(xk, xu, h, np.uint64(hid))
                if x < 0:
                    x = -x - 1
                    xk[x, 0], xk[x, 1] = h, np.uint64(hid)
                    xv[x, 0] = 1
                    xu[x] = 1
                    xn[0] += 1
                else:
                    xv[x, 0] += 1
            else:
                hv[i, w] |= bit
        elif i < 0 or not hv[i, w] & bit:
            stats[0] += 1
        else:
            x = _find(xk, xu, h, np.uint64(hid)) if xn[0] else -1
            if x >= 0:
                xv[x, 0] -= 1
                if xv[x, 0] == 0:
                    _delete(xk, xu, xv, x)
                    xn[0] -= 1
            else:
                hv[i, w] &= ~bit
                if not hv[i].any():
                    _delete(hk, hu, hv, i)
                    hn[0] -= 1
        pos += 1
    return pos


@numba.njit(cache=True, nogil=True)
def _clear(hk, hu, hv, hn, xk, xu, xv, xn, hid):
    """Drop every hash of holder `hid`."""
    w = hid // 64
    bit = np.uint64(1) << np.uint64(hid % 64)
    i = 0
    while i < len(hu):  # a deletion shifts a later row back into i: look at i again
        if hu[i] and hv[i, w] & bit:
            hv[i, w] &= ~bit
            if not hv[i].any():
                _delete(hk, hu, hv, i)
                hn[0] -= 1
                continue
        i += 1
    i = 0
    tag = np.uint64(hid)
    while i < len(xu):
        if xu[i] and xk[i, 1] == tag:
            _delete(xk, xu, xv, i)
            xn[0] -= 1
            continue
        i += 1


@numba.njit(cache=True, nogil=True)
def _held(hk, hu, hv, words, bits, out):
    """Keys of the rows holding any of `bits`; returns how many were written to out."""
    n = 0
    for i in range(len(hu)):
        if hu[i]:
            for w in range(words):
                if hv[i, w] & bits[w]:
                    out[n] = hk[i, 0]
                    n += 1
                    break
    return n


@numba.njit(cache=True, nogil=True)
def _lookup(hk, hu, hv, hashes, out, start, zeros, run):
    """Holder bits of `hashes` into out[start:]; stops after `run` consecutive units nobody
    holds (counting `zeros` already seen). Returns the zeros run at the end."""
    for u in range(len(hashes)):
        i = _find(hk, hu, hashes[u], np.uint64(0))
        if i >= 0:
            out[start + u, :] = hv[i, :]
            zeros = 0
        else:
            zeros += 1
            if zeros >= run:
                return zeros
    return zeros


@numba.njit(cache=True, nogil=True)
def _rehash(ok, ou, ov, nk, nu, nv):
    for i in range(len(ou)):
        if ou[i]:
            j = _find(nk, nu, ok[i, 0], ok[i, 1])
            j = -j - 1
            nk[j, 0], nk[j, 1] = ok[i, 0], ok[i, 1]
            nv[j, :ov.shape[1]] = ov[i, :]
            nu[j] = 1


class _Table:
    """One open-addressing table's arrays: keys (k0, k1), used flags, values, and its size."""

    def __init__(self, width: int, capacity: int = _MIN_CAPACITY):
        self.keys = np.zeros((capacity, 2), np.uint64)
        self.used = np.zeros(capacity, np.uint8)
        self.vals = np.zeros((capacity, width), np.uint64)
        self.n = np.zeros(1, np.int64)

    @property
    def limit(self) -> int:
        return int(len(self.used) * _LOAD)

    def resize(self, capacity: int, width: int) -> None:
        keys = np.zeros((capacity, 2), np.uint64)
        used = np.zeros(capacity, np.uint8)
        vals = np.zeros((capacity, width), np.uint64)
        _rehash(self.keys, self.used, self.vals, keys, used, vals)
        self.keys, self.used, self.vals = keys, used, vals

    def grow(self) -> None:
        self.resize(len(self.used) * 2, self.vals.shape[1])


class HeldTable:
    """Which holders hold each hash, with store counts (module docstring). Holders are numbered
    from 0 by the index; `words` grows as they pass multiples of 64."""

    def __init__(self):
        self.words = 1
        self.held = _Table(1)
        self.extra = _Table(1)
        self._stats = np.zeros(1, np.int64)

    def __len__(self) -> int:
        return int(self.held.n[0])

    @property
    def unknown_removals(self) -> int:
        return int(self._stats[0])

    def add_holder(self, hid: int) -> None:
        """Make room for holder `hid`'s bit."""
        if hid // 64 + 1 > self.words:
            self.words = hid // 64 + 1
            self.held.resize(len(self.held.used), self.words)

    def apply(self, hashes: np.ndarray, ends: np.ndarray, holders: np.ndarray, ops: np.ndarray) -> None:
        """Runs of stores and removals, in order: run s is hashes[ends[s-1]:ends[s]] of holder
        holders[s], ops[s] STORE or REMOVE."""
        pos = 0
        held, extra = self.held, self.extra
        while True:
            pos = _apply(held.keys, held.used, held.vals, held.n, extra.keys, extra.used, extra.vals, extra.n,
                         hashes, ends, holders, ops, pos, held.limit, extra.limit, self._stats)
            if pos >= len(hashes):
                return
            if held.n[0] >= held.limit:
                held.grow()
            if extra.n[0] >= extra.limit:
                extra.grow()

    def clear(self, hid: int) -> None:
        """Forget every hash of holder `hid`."""
        held, extra = self.held, self.extra
        _clear(held.keys, held.used, held.vals, held.n, extra.keys, extra.used, extra.vals, extra.n, hid)

    def held_by(self, holder_ids: Sequence[int]) -> set[int]:
        """The keys any of `holder_ids` holds (a scan: for tests and inspection)."""
        bits = self.bits(holder_ids)
        out = np.empty(len(self), np.uint64)
        n = _held(self.held.keys, self.held.used, self.held.vals, self.words, bits, out)
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
        held = self.held
        return _lookup(held.keys, held.used, held.vals, keys, out, start, zeros, run)
