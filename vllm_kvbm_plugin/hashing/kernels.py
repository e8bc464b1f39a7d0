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


@numba.njit(inline="always")
def _token_hash(tokens, base, unit, ulen):
    ta = _TA
    tb = _TB
    for j in range(unit):
        w = np.uint64(tokens[base + j])
        ta = _absorb(ta, w)
        tb = _absorb(tb, w)
    return _mix64(ta ^ ulen), _mix64(tb ^ ulen)


@numba.njit(cache=True, nogil=True)
def unit_keys(tokens, unit, root_a, root_b, extras):
    """tokens: int64[n]; extras: uint64[n // unit, 2] (zeros = none) -> uint64[n // unit, 2].

    Token hashes do not depend on the parent, so they are computed first, four units at a time:
    eight independent multiply chains keep the core busy (one unit's two chains wait on each
    multiply; twice as fast overall). The chaining pass then runs unit by unit."""
    n_units = tokens.shape[0] // unit
    th = np.empty((n_units, 2), dtype=np.uint64)
    ulen = np.uint64(unit)
    i = 0
    while i + 4 <= n_units:
        a0 = a1 = a2 = a3 = _TA
        b0 = b1 = b2 = b3 = _TB
        o0, o1, o2, o3 = i * unit, (i + 1) * unit, (i + 2) * unit, (i + 3) * unit
        for j in range(unit):
            w0, w1 = np.uint64(tokens[o0 + j]), np.uint64(tokens[o1 + j])
            w2, w3 = np.uint64(tokens[o2 + j]), np.uint64(tokens[o3 + j])
            a0, b0 = _absorb(a0, w0), _absorb(b0, w0)
            a1, b1 = _absorb(a1, w1), _absorb(b1, w1)
            a2, b2 = _absorb(a2, w2), _absorb(b2, w2)
            a3, b3 = _absorb(a3, w3), _absorb(b3, w3)
        th[i, 0], th[i, 1] = _mix64(a0 ^ ulen), _mix64(b0 ^ ulen)
        th[i + 1, 0], th[i + 1, 1] = _mix64(a1 ^ ulen), _mix64(b1 ^ ulen)
        th[i + 2, 0], th[i + 2, 1] = _mix64(a2 ^ ulen), _mix64(b2 ^ ulen)
        th[i + 3, 0], th[i + 3, 1] = _mix64(a3 ^ ulen), _mix64(b3 ^ ulen)
        i += 4
    while i < n_units:
        th[i, 0], th[i, 1] = _token_hash(tokens, i * unit, unit, ulen)
        i += 1
    out = np.empty((n_units, 2), dtype=np.uint64)
    pa = np.uint64(root_a)
    pb = np.uint64(root_b)
    six = np.uint64(6)
    for i in range(n_units):
        ta, tb, ea, eb = th[i, 0], th[i, 1], extras[i, 0], extras[i, 1]
        ca = _absorb(_absorb(_absorb(_absorb(_absorb(_absorb(_CA, pa), pb), ta), tb), ea), eb)
        cb = _absorb(_absorb(_absorb(_absorb(_absorb(_absorb(_CB, pa), pb), ta), tb), ea), eb)
        pa = _mix64(ca ^ six)
        pb = _mix64(cb ^ six)
        out[i, 0] = pa
        out[i, 1] = pb
    return out


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
