"""The MAC of a block file or remote value, keyed by the tier secret (tiers/secret.py).

UMAC's shape in our own loop: each 8 KiB chunk of the payload is compressed by two NH passes (the
32-bit halves of each word, each plus a key half mod 2^32, multiplied and summed mod 2^64; the
second pass's key shifted by one word), the chunks' outputs (four 32-bit coefficients each) are
evaluated as a polynomial at a secret point mod 2^61-1, and the 64-bit tag is SipHash-2-4 (a key
of its own) of the header's fields, that value and the metadata. Two payloads of n chunks collide
with probability at most 2^-64 + 4n/(2^61-1) over the key, so without the secret a forged value
passes with probability about 2^-64 + n * 2^-59 (2^-52 for 1 MiB) plus SipHash's PRF advantage;
random corruption is caught as well, so this replaces the checksum of format 2.

All key words come from the secret (keyed BLAKE2b in counter mode): whoever holds it can write
blocks the tiers serve (docs/block-keys.md says what to protect). The NH loop carries two sums and
vectorizes like a checksum; the readers run it on each chunk while it is in cache, fused with the
copy out (tiers/fileio.py, the remote reader).
"""

from __future__ import annotations

import functools
import hashlib

import numba
import numpy as np

from vllm_kvbm_plugin.hashing.kernels import _absorb, _round, _start
from vllm_kvbm_plugin.tiers.copy import _copy_words, _fence

CHUNK_WORDS = 1024  # 8 KiB per NH chunk: the key is as long (and stays in L1)
_NH_AT = 4  # key[0]: the polynomial's point, key[1:3]: the PRF key, then the NH key words
KEY_WORDS = _NH_AT + CHUNK_WORDS + 1
_P = np.uint64((1 << 61) - 1)
_LO32 = np.uint64(0xFFFFFFFF)
_LO29 = np.uint64((1 << 29) - 1)
_S3, _S29, _S32, _S61 = np.uint64(3), np.uint64(29), np.uint64(32), np.uint64(61)
_FF = np.uint64(0xFF)
_B8 = np.uint64(8)


@functools.lru_cache(maxsize=8)
def mac_key(secret: bytes) -> np.ndarray:
    """The key words derived from a 16-byte tier secret (read-only uint64[KEY_WORDS])."""
    if len(secret) != 16:
        raise ValueError(f"a tier secret is 16 bytes, got {len(secret)}")
    raw = b"".join(hashlib.blake2b(b"kvbm-mac" + i.to_bytes(8, "little"), key=secret, digest_size=64,
                                   person=b"kvbm-block-mac").digest() for i in range(-(-KEY_WORDS // 8)))
    words = np.frombuffer(raw, dtype=np.uint64)[:KEY_WORDS].copy()
    words[0] %= _P  # the point: an element of the field
    words.flags.writeable = False
    return words


@numba.njit(inline="always")
def _mulmod(a, b):
    """a * b mod 2^61-1 for a, b < 2^61 (2^61 = 1 and 2^64 = 8 there)."""
    a0, a1, b0, b1 = a & _LO32, a >> _S32, b & _LO32, b >> _S32
    lo, mid, hi = a0 * b0, a0 * b1 + a1 * b0, a1 * b1
    r = (lo & _P) + (lo >> _S61) + (hi << _S3) + ((mid & _LO29) << _S32) + (mid >> _S29)
    r = (r & _P) + (r >> _S61)
    r = (r & _P) + (r >> _S61)
    return r - _P if r >= _P else r


@numba.njit(inline="always")
def _fold(acc, key):
    """Add the finished chunk's two NH sums to the polynomial, start a new chunk."""
    h, x = acc[2], key[0]
    for y in (acc[0], acc[1]):
        h = _mulmod(h, x) + (y >> _S32)
        h = _mulmod(h, x) + (y & _LO32)
    acc[0] = acc[1] = 0
    acc[2] = h - _P if h >= _P else h


@numba.njit(inline="always")
def _nh_run(s1, s2, x, k1, k2):
    """The two NH sums over the words `x` with key words k1 and (shifted by one) k2: each 32-bit
    half of a word plus the key word's same half, mod 2^32, the two multiplied."""
    for t in range(x.shape[0]):
        hi = x[t] >> _S32
        s1 += ((x[t] + k1[t]) & _LO32) * ((hi + (k1[t] >> _S32)) & _LO32)
        s2 += ((x[t] + k2[t]) & _LO32) * ((hi + (k2[t] >> _S32)) & _LO32)
    return s1, s2


@numba.njit(inline="always")
def _nh(acc, key, words, w):
    """Feed `words`, which start at word `w` of the payload, into acc (NH sums and polynomial)."""
    k = key[_NH_AT:]
    i, n = 0, words.shape[0]
    while i < n:
        j = w % CHUNK_WORDS
        m = min(CHUNK_WORDS - j, n - i)
        acc[0], acc[1] = _nh_run(acc[0], acc[1], words[i: i + m], k[j: j + m], k[j + 1: j + 1 + m])
        i += m
        w += m
        if w % CHUNK_WORDS == 0:
            _fold(acc, key)


@numba.njit(cache=True, nogil=True)
def mac_update(acc: np.ndarray, key: np.ndarray, data: np.ndarray, offset: int,
               copy_to: np.ndarray | None = None) -> None:
    """Feed uint8 `data`, which starts `offset` bytes (a multiple of 8) into the payload, into
    `acc` (uint64[3], zeros to start). Pieces come in order; only the last may end off a word
    boundary (zero-padded). With `copy_to` (as long as `data`), data is then copied there, with
    streaming stores when both are whole words (read from cache once more)."""
    nwords = data.shape[0] // 8
    words = data[: nwords * 8].view(np.uint64)
    _nh(acc, key, words, offset // 8)
    if nwords * 8 < data.shape[0]:
        tail = np.zeros(1, dtype=np.uint64)
        for j in range(data.shape[0] - nwords * 8):
            tail[0] |= np.uint64(data[nwords * 8 + j]) << np.uint64(8 * j)
        _nh(acc, key, tail, offset // 8 + nwords)
    if copy_to is not None:
        if nwords * 8 == data.shape[0] and copy_to.ctypes.data % 8 == 0:
            _copy_words(copy_to.view(np.uint64), 0, words, 0, nwords, True)
            _fence()
        else:
            copy_to[:] = data


@numba.njit(cache=True, nogil=True)
def mac_final(acc: np.ndarray, key: np.ndarray, head: np.ndarray, meta: np.ndarray) -> np.uint64:
    """The tag of a payload fed into `acc`, with the header `head` (its first 52 bytes: magic to
    the lengths) and the metadata `meta` (uint8 arrays)."""
    if ((_le8(head, 40, 8) + np.uint64(7)) // _B8) % np.uint64(CHUNK_WORDS):  # a partial last chunk
        _fold(acc, key)
    v0, v1, v2, v3 = _start(key[1], key[2], False)
    for i in range(6):
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, _le8(head, 8 * i, 8), 2)
    v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, _le8(head, 48, 4), 2)
    v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, acc[2], 2)
    n = meta.shape[0]
    for i in range(n // 8):
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, _le8(meta, 8 * i, 8), 2)
    last = np.uint64((64 + n) & 0xFF) << np.uint64(56)
    last |= _le8(meta, n - n % 8, n % 8)
    v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, last, 2)
    v2 ^= _FF
    for _ in range(4):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


@numba.njit(inline="always")
def _le8(buf, at, n):
    """The little-endian integer of buf[at:at+n] (n <= 8)."""
    x = np.uint64(0)
    for j in range(n):
        x |= np.uint64(buf[at + j]) << (_B8 * np.uint64(j))
    return x


@numba.njit(cache=True, nogil=True)
def block_mac(key: np.ndarray, head: np.ndarray, payload: np.ndarray, meta: np.ndarray) -> np.uint64:
    """The tag of a whole payload (uint8 arrays)."""
    acc = np.zeros(3, dtype=np.uint64)
    mac_update(acc, key, payload, 0)
    return mac_final(acc, key, head, meta)
