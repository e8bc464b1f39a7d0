"""The payload checksum of block format 2 (before the MAC, tiers/mac.py), kept here only as the
baseline the benchmarks time the MAC against in the same run: not a MAC, anyone can compute it."""

import numba
import numpy as np

_CK = np.uint64(0x9E3779B185EBCA87)
_LO32, _S32 = np.uint64(0xFFFFFFFF), np.uint64(32)


@numba.njit(cache=True, nogil=True)
def checksum_sums(data):
    """Format 2's two sums over the whole words of `data` (its final mixing is a few ns)."""
    words = data[: data.shape[0] // 8 * 8].view(np.uint64)
    h1, h2, c = np.uint64(0), np.uint64(0), np.uint64(0)
    for i in range(words.shape[0]):
        x = words[i] ^ c
        h1, h2 = h1 + x, h2 + (x & _LO32) * (x >> _S32)
        c += _CK
    return h1 ^ h2
