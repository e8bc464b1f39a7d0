"""numba row copies between vLLM's CPU KV tensors and the CPU pool: one pass per block and layer,
no temporaries (torch's gather-then-scatter copies every byte twice). Rows are uint64 words (block
byte sizes are multiples of 8), which LLVM turns into wide vector moves."""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def rows_to_slots(src, block_ids, dst, slots, offset):
    """dst[slots[i], offset:offset+w] = src[block_ids[i], :] (uint64 rows; offset in words)."""
    w = src.shape[1]
    for i in range(block_ids.shape[0]):
        dst[slots[i], offset : offset + w] = src[block_ids[i], :]


@numba.njit(cache=True, nogil=True)
def slots_to_rows(src, slots, offset, dst, block_ids):
    """dst[block_ids[i], :] = src[slots[i], offset:offset+w]."""
    w = dst.shape[1]
    for i in range(block_ids.shape[0]):
        dst[block_ids[i], :] = src[slots[i], offset : offset + w]
