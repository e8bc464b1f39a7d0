"""numba copies between vLLM's CPU KV tensors and the CPU pool: one pass per block and layer, no
temporaries (torch's gather-then-scatter copies every byte twice), blocks spread over threads.

Both sides are flat uint64 arrays (block byte sizes are multiples of 8): a layer holds `w` words
per block, a pool slot `total` words, the layer's part of a slot starts at word `offset`.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def rows_to_slots(src, w, block_ids, dst, total, slots, offset):
    """Slot slots[i] words [offset, offset+w) <- block block_ids[i] of the layer."""
    for i in range(block_ids.shape[0]):
        a = slots[i] * total + offset
        b = block_ids[i] * w
        dst[a : a + w] = src[b : b + w]


@numba.njit(cache=True, nogil=True)
def slots_to_rows(src, total, slots, offset, dst, w, block_ids):
    """Block block_ids[i] of the layer <- slot slots[i] words [offset, offset+w)."""
    for i in range(block_ids.shape[0]):
        a = slots[i] * total + offset
        b = block_ids[i] * w
        dst[b : b + w] = src[a : a + w]
