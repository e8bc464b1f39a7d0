"""What a worker serves of a prompt, from the holder bits of the prompt's hash units (events/index.py
looks them up in events/held_table.py): vLLM's prefix-cache rule and the connector's tier rule, in
numba. A unit's row holds the bits of every holder (worker, tier, group) of its hash; a holder set
is a row of bits in the same words ("bits").
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True, inline="always")
def _has_all(row, bits):
    for w in range(len(bits)):
        if row[w] & bits[w] != bits[w]:
            return False
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _any(bits):
    for w in range(len(bits)):
        if bits[w]:
            return True
    return False


@numba.njit(cache=True, nogil=True)
def gpu_hit_units(masks: np.ndarray, kv: np.ndarray, st: np.ndarray, hybrid: bool, limit: int) -> int:
    """vLLM's prefix-cache hit in units, at most `limit`: the units held by every attention group
    (`kv`), and for hybrid models the last of them with a state held by every state group (`st`)."""
    k = 0
    while k < limit and k < len(masks) and _has_all(masks[k], kv):
        k += 1
    if not hybrid:
        return k
    if not _any(st):
        return 0
    for u in range(k, 0, -1):
        if _has_all(masks[u - 1], st):
            return u
    return 0


@numba.njit(cache=True, nogil=True, inline="always")
def _held(masks, u, which, tiers):
    """Unit u (1-based) held in one of `tiers` by all its groups of a kind (0 attention, 1 state)."""
    if u < 1 or u > len(masks):
        return False
    for t in range(tiers.shape[0]):
        if _any(tiers[t, which]) and _has_all(masks[u - 1], tiers[t, which]):
            return True
    return False


@numba.njit(cache=True, nogil=True)
def tier_hit(gpu: int, n: int, unit: int, block: int, hybrid: bool, masks: np.ndarray,
             tiers: np.ndarray, mid_tiers: np.ndarray) -> int:
    """KVBMConnector's hit after a GPU hit of `gpu` tokens (connector/scheduler.py `_plan`) with
    entries in any of `tiers` [(attention bits, state bits)]: blocks from the GPU hit's block on,
    and for hybrid models the largest X with a tier state at X, inside a block only from
    `mid_tiers`. 0 when the tiers add nothing. The partial KV entry a mid-block state needs is
    never announced: it is taken to be held with the state."""
    limit = n - 1
    r = max(block // unit, 1)
    start = gpu // block
    full = start
    while (full + 1) * block <= limit and _held(masks, (full + 1) * r, 0, tiers):
        full += 1
    if not hybrid:
        hit = full * block
        if (full + 1) * block == limit + 1 and _held(masks, (full + 1) * r, 0, tiers):
            full, hit = full + 1, limit  # a block-aligned prompt's last block, loaded whole
        return hit if full > start else 0
    lo = start * r
    for u in range(min(limit // unit, len(masks)), lo, -1):
        if u // r > full:
            continue
        # X inside a block: the connector also needs the block's KV up to X, which it stores with
        # the state as an entry it never announces; a state event stands for both
        if _held(masks, u, 1, tiers if u % r == 0 else mid_tiers):
            return u * unit
    return 0
