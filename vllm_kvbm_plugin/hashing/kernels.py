"""numba kernels for the keyed two-stage block keys (spec: `spec.py`, docs/block-keys.md).

One call computes every unit key of a request: token hashes and chaining in one pass over the
token ids, no Python objects per token or per unit. Every hash is SipHash-c-d with 128-bit output
(c, d = spec.C_ROUNDS, spec.D_ROUNDS), keyed by the tier secret's words k0, k1.
"""

from __future__ import annotations

import numba
import numpy as np

# The constants are spelled out here, not read from spec: numba's cache keeps a kernel compiled
# with the values it saw until this file changes. tests/unit/test_hashing.py checks they agree.
_C, _D = 2, 4  # spec.C_ROUNDS, spec.D_ROUNDS: SipHash-2-4
_I0, _I1, _I2, _I3 = (np.uint64(x) for x in (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261,
                                             0x7465646279746573))
_EE, _DD, _FF = np.uint64(0xEE), np.uint64(0xDD), np.uint64(0xFF)
_R13, _R16, _R17, _R21, _R32 = (np.uint64(r) for r in (13, 16, 17, 21, 32))
_R51, _R48, _R47, _R43 = (np.uint64(r) for r in (51, 48, 47, 43))
_S56, _B8 = np.uint64(56), np.uint64(8)
_TOKEN_TAG, _EXTRA_TAG, _CHAIN_TAG = (np.uint64(int.from_bytes(t, "little"))
                                      for t in (b"kvbm:tok", b"kvbm:ext", b"kvbm:chn"))
_CHAIN_LAST = np.uint64(56) << _S56  # a chain message is 56 bytes: tag and six words


@numba.njit(inline="always")
def _round(v0, v1, v2, v3):
    v0 += v1
    v1 = ((v1 << _R13) | (v1 >> _R51)) ^ v0
    v0 = (v0 << _R32) | (v0 >> _R32)
    v2 += v3
    v3 = ((v3 << _R16) | (v3 >> _R48)) ^ v2
    v0 += v3
    v3 = ((v3 << _R21) | (v3 >> _R43)) ^ v0
    v2 += v1
    v1 = ((v1 << _R17) | (v1 >> _R47)) ^ v2
    v2 = (v2 << _R32) | (v2 >> _R32)
    return v0, v1, v2, v3


@numba.njit(inline="always")
def _absorb(v0, v1, v2, v3, m, c):
    v3 ^= m
    for _ in range(c):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    return v0 ^ m, v1, v2, v3


@numba.njit(inline="always")
def _start(k0, k1, wide):
    return k0 ^ _I0, (k1 ^ _I1 ^ _EE) if wide else (k1 ^ _I1), k0 ^ _I2, k1 ^ _I3


@numba.njit(inline="always")
def _finish(v0, v1, v2, v3, d):
    """The 128-bit output after the last block: (first half, second half)."""
    v2 ^= _EE
    for _ in range(d):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    a = v0 ^ v1 ^ v2 ^ v3
    v1 ^= _DD
    for _ in range(d):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    return a, v0 ^ v1 ^ v2 ^ v3


@numba.njit(inline="always")
def _after_tag(k0, k1, tag):
    v0, v1, v2, v3 = _start(k0, k1, True)
    return _absorb(v0, v1, v2, v3, tag, _C)


@numba.njit(cache=True, nogil=True)
def unit_keys(tokens: np.ndarray, unit: int, root_a: np.uint64, root_b: np.uint64, extras: np.ndarray,
              k0: np.uint64, k1: np.uint64) -> np.ndarray:
    """tokens: int64[n]; extras: uint64[n // unit, 2] (zeros = none) -> uint64[n // unit, 2].

    Token hashes do not depend on the parent, so they are computed first, two units at a time:
    two independent SipHash states keep the core busy (one waits on its own round's adds and
    rotations). Measured and not kept: three states (no faster, 16 live words spill). The chaining
    pass then runs unit by unit."""
    n_units = tokens.shape[0] // unit
    th = np.empty((n_units, 2), dtype=np.uint64)
    last = np.uint64((8 * (unit + 1)) & 0xFF) << _S56  # the length byte of a token message
    t0, t1, t2, t3 = _after_tag(k0, k1, _TOKEN_TAG)
    i = 0
    while i + 2 <= n_units:
        a0, a1, a2, a3 = t0, t1, t2, t3
        b0, b1, b2, b3 = t0, t1, t2, t3
        oa, ob = i * unit, (i + 1) * unit
        for j in range(unit):
            a0, a1, a2, a3 = _absorb(a0, a1, a2, a3, np.uint64(tokens[oa + j]), _C)
            b0, b1, b2, b3 = _absorb(b0, b1, b2, b3, np.uint64(tokens[ob + j]), _C)
        a0, a1, a2, a3 = _absorb(a0, a1, a2, a3, last, _C)
        b0, b1, b2, b3 = _absorb(b0, b1, b2, b3, last, _C)
        th[i, 0], th[i, 1] = _finish(a0, a1, a2, a3, _D)
        th[i + 1, 0], th[i + 1, 1] = _finish(b0, b1, b2, b3, _D)
        i += 2
    while i < n_units:
        a0, a1, a2, a3 = t0, t1, t2, t3
        for j in range(unit):
            a0, a1, a2, a3 = _absorb(a0, a1, a2, a3, np.uint64(tokens[i * unit + j]), _C)
        a0, a1, a2, a3 = _absorb(a0, a1, a2, a3, last, _C)
        th[i, 0], th[i, 1] = _finish(a0, a1, a2, a3, _D)
        i += 1
    out = np.empty((n_units, 2), dtype=np.uint64)
    c0, c1, c2, c3 = _after_tag(k0, k1, _CHAIN_TAG)
    pa = np.uint64(root_a)
    pb = np.uint64(root_b)
    for i in range(n_units):
        v0, v1, v2, v3 = _absorb(c0, c1, c2, c3, pa, _C)
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, pb, _C)
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, th[i, 0], _C)
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, th[i, 1], _C)
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, extras[i, 0], _C)
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, extras[i, 1], _C)
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, _CHAIN_LAST, _C)
        pa, pb = _finish(v0, v1, v2, v3, _D)
        out[i, 0] = pa
        out[i, 1] = pb
    return out


@numba.njit(inline="always")
def _word(data, base, n):
    """Little-endian word of data[base: base + n] (n <= 8; the rest zero)."""
    w = np.uint64(0)
    for j in range(n):
        w |= np.uint64(data[base + j]) << np.uint64(8 * j)
    return w


@numba.njit(cache=True, nogil=True)
def siphash(data: bytes | np.ndarray, k0: np.uint64, k1: np.uint64, c: int, d: int,
            wide: bool) -> tuple[np.uint64, np.uint64]:
    """spec.siphash of a bytes object (or uint8 array), as (first half, second half); the 64-bit
    output is the first half when not `wide`. For the published test vectors."""
    n = len(data)
    v0, v1, v2, v3 = _start(k0, k1, wide)
    full = n // 8
    for i in range(full):
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, _word(data, i * 8, 8), c)
    last = _word(data, full * 8, n - full * 8) | (np.uint64(n & 0xFF) << _S56)
    v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, last, c)
    if wide:
        return _finish(v0, v1, v2, v3, d)
    v2 ^= _FF
    for _ in range(d):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3, np.uint64(0)


@numba.njit(cache=True, nogil=True)
def extra_hash(data: bytes | np.ndarray, k0: np.uint64, k1: np.uint64) -> tuple[np.uint64, np.uint64]:
    """spec.extra_hash of already msgpack-encoded extra keys `data`: SipHash of the extra tag and
    `data`."""
    n = len(data)
    v0, v1, v2, v3 = _after_tag(k0, k1, _EXTRA_TAG)
    full = n // 8
    for i in range(full):
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, _word(data, i * 8, 8), _C)
    last = _word(data, full * 8, n - full * 8) | (np.uint64((n + 8) & 0xFF) << _S56)
    v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, last, _C)
    return _finish(v0, v1, v2, v3, _D)
