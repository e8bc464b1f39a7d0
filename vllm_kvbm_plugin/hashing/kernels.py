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
