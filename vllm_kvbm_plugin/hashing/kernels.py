"""numba kernel for the two-stage block keys (spec: `spec.py`, docs/block-keys.md).

One call computes every unit key of a request: token hashes and chaining in one pass over the
token ids, no Python objects per token or per unit.
"""

from __future__ import annotations

import numba
import numpy as np

from vllm_kvbm_plugin.hashing import spec

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_G = np.uint64(spec.GOLDEN)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_TA, _TB = np.uint64(spec.TOKEN_SEEDS[0]), np.uint64(spec.TOKEN_SEEDS[1])
_CA, _CB = np.uint64(spec.CHAIN_SEEDS[0]), np.uint64(spec.CHAIN_SEEDS[1])


@numba.njit(inline="always")
def _mix64(z):
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


@numba.njit(inline="always")
def _absorb(h, w):
    return _mix64((h ^ w) + _G)


@numba.njit(cache=True, nogil=True)
def unit_keys(tokens, unit, root_a, root_b, extras):
    """tokens: int64[n]; extras: uint64[n // unit, 2] (zeros = none) -> uint64[n // unit, 2]."""
    n_units = tokens.shape[0] // unit
    out = np.empty((n_units, 2), dtype=np.uint64)
    pa = np.uint64(root_a)
    pb = np.uint64(root_b)
    ulen = np.uint64(unit)
    six = np.uint64(6)
    for i in range(n_units):
        ta = _TA
        tb = _TB
        base = i * unit
        for j in range(unit):
            w = np.uint64(tokens[base + j])
            ta = _absorb(ta, w)
            tb = _absorb(tb, w)
        ta = _mix64(ta ^ ulen)
        tb = _mix64(tb ^ ulen)
        ea = extras[i, 0]
        eb = extras[i, 1]
        ca = _absorb(_absorb(_absorb(_absorb(_absorb(_absorb(_CA, pa), pb), ta), tb), ea), eb)
        cb = _absorb(_absorb(_absorb(_absorb(_absorb(_absorb(_CB, pa), pb), ta), tb), ea), eb)
        pa = _mix64(ca ^ six)
        pb = _mix64(cb ^ six)
        out[i, 0] = pa
        out[i, 1] = pb
    return out


_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)


CHECKSUM_LANES = np.array([_P1, _P2, _P3, _P4], dtype=np.uint64)  # checksum64's starting lanes


@numba.njit(cache=True, nogil=True)
def checksum_step(lanes, data, total, last):
    """checksum64 in pieces, so each piece is checksummed right after it is read: feeds uint8
    `data` into `lanes` (a copy of CHECKSUM_LANES; every piece but the last a multiple of 32 bytes); the
    last piece returns checksum64 of all `total` bytes (tests hold it equal)."""
    n = data.shape[0]
    nwords = n // 8
    words = data[: nwords * 8].view(np.uint64)
    a, b, c, d = lanes[0], lanes[1], lanes[2], lanes[3]
    i = 0
    while i + 4 <= nwords:
        a = (a ^ words[i]) * _P1
        b = (b ^ words[i + 1]) * _P2
        c = (c ^ words[i + 2]) * _P3
        d = (d ^ words[i + 3]) * _P4
        i += 4
    lanes[0], lanes[1], lanes[2], lanes[3] = a, b, c, d
    if not last:
        return np.uint64(0)
    while i < nwords:
        a = (a ^ words[i]) * _P1
        i += 1
    for j in range(nwords * 8, n):
        b = (b ^ np.uint64(data[j])) * _P2
    h = _mix64(a) ^ _mix64(b + _P1) ^ _mix64(c + _P2) ^ _mix64(d + _P3)
    return _mix64(h ^ np.uint64(total))


@numba.njit(cache=True, nogil=True)
def checksum64(data):
    """64-bit checksum of a uint8 array at memory speed: four multiply-xor lanes over 64-bit
    words, then the tail bytes and the length, finalised with mix64. Every change of a single
    word changes the result (the lane update is a bijection); other corruptions collide with
    probability about 2^-64. Not a cryptographic hash."""
    return checksum_step(CHECKSUM_LANES.copy(), data, data.shape[0], True)


_BA, _BB = np.uint64(spec.BYTES_SEEDS[0]), np.uint64(spec.BYTES_SEEDS[1])


@numba.njit(cache=True, nogil=True)
def bytes_hash(data):
    """spec.hash_bytes of a bytes object (or uint8 array): both lanes over its little-endian
    64-bit words (the last one zero-padded), then its length in bytes, then the word count."""
    n = len(data)
    ha = _BA
    hb = _BB
    full = n // 8
    for i in range(full):
        base = i * 8
        w = np.uint64(0)
        for j in range(8):
            w |= np.uint64(data[base + j]) << np.uint64(8 * j)
        ha = _absorb(ha, w)
        hb = _absorb(hb, w)
    nwords = full
    if full * 8 < n:  # zero-padded tail word
        w = np.uint64(0)
        for j in range(n - full * 8):
            w |= np.uint64(data[full * 8 + j]) << np.uint64(8 * j)
        ha = _absorb(ha, w)
        hb = _absorb(hb, w)
        nwords += 1
    ln = np.uint64(n)
    ha = _absorb(ha, ln)
    hb = _absorb(hb, ln)
    cnt = np.uint64(nwords + 1)
    return _mix64(ha ^ cnt), _mix64(hb ^ cnt)
