"""Position-independent loads (issue 12, layer 2), worker side: run the `PicLoad`s the scheduler's
PicPlanner (connector/pic_planner.py) put into a step's metadata. Runs in each worker process,
called by WorkerSide.start_load_kv before the forward, with the worker's KV layers, CPU pool and
two callbacks (load errors, stats counters) instead of the WorkerSide itself.

Per attention layer, K of the loaded tokens is re-rotated from the old to the new positions in
float32 (`reuse.rope`, with the model's own RoPE parameters, connector/pic_model.py) and V copied,
in vLLM's CPU KV layout (`reuse.cpu_layout.kv_views`). With selective recompute
(`pic_recompute_ratio` > 0) the loads are also handed to this step's attention patch as a
`BlendPlan` attached to the step's vLLM forward context (`pic_blend.attach`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numba
import numpy as np
import torch

from vllm_kvbm_plugin.connector.metadata import PicLoad
from vllm_kvbm_plugin.connector.pic_model import PicModel
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.patches.pic_blend import RUN_HEAD, BlendPlan, attach, tp_group
from vllm_kvbm_plugin.reuse.cpu_layout import kv_views
from vllm_kvbm_plugin.reuse.rope import RopeSpec, rerotate

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

logger = get_logger("connector.pic")


@functools.lru_cache(maxsize=4)
def _cos_sin(rope: RopeSpec, max_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """The table rounded to the KV's dtype, as vLLM's CPU RoPE uses it (bf16: about 20% less
    error against the K computed at the new position than the exact table)."""
    return rope.cos_sin_cache(max_positions, dtype)


def load(ops: list[PicLoad], model: PicModel, block_size: int, kv_layers: list, pool: torch.Tensor,
         recompute_ratio: float, failed: Callable[[Iterable[int]], None],
         count: Callable[[dict], None], forward_context: ForwardContext | None = None) -> None:
    """Run position-independent loads: per attention layer, K of the slot tokens re-rotated from
    their old to their new positions in float32, V copied (`kv_views`); a layer of another shape
    fails the loads (their block ids go to `failed`, reported as load errors, so vLLM recomputes
    those blocks).

    `kv_layers`: per KV cache group, its layers (each with `tensor`, block dimension `dim` and
    byte `offset` inside a slot); `pool`: the CPU tier's slots [slots, slot bytes]; `count`: adds
    a dict of counters to the worker's stats (thread-safe on the caller's side); `forward_context`:
    the step's vLLM ForwardContext, which carries the blend plan (`recompute_ratio` > 0)."""
    t0 = time.perf_counter()
    rope = model.rope
    D, B = rope.head_size, block_size
    # one row per token: which op (slot), where in the slot's block, where it goes, its positions
    counts = torch.tensor([o.count for o in ops])
    op = torch.repeat_interleave(torch.arange(len(ops)), counts)
    within = torch.arange(len(op)) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    src_at = torch.tensor([o.src_offset for o in ops])[op] + within
    dst_at = torch.tensor([o.dst_offset for o in ops])[op] + within
    old = torch.tensor([o.old_position for o in ops])[op] + within
    new = torch.tensor([o.new_position for o in ops])[op] + within
    slots = torch.tensor([o.slot for o in ops])
    for gi, layers in enumerate(kv_layers):
        dst_ids = torch.tensor([o.block_ids[gi] for o in ops])[op]
        # torch path: the destination blocks are copied out, written and copied back (indexed
        # writes into a view of the whole KV cache would copy all of it)
        blocks, dst_block = torch.unique(dst_ids, return_inverse=True)
        slots_np, op_np, src_np, blocks_np, at_np, old_np, new_np = (
            x.numpy() for x in (slots, op, src_at, dst_ids, dst_at, old, new))
        for layer in layers:
            t = layer.tensor
            if t.dim() != 4 or layer.dim != 0 or t.shape[2] != B or t.shape[3] != 2 * D:
                logger.error("KVBMConnector: position-independent loads need vLLM's CPU KV layout "
                             "[blocks, heads, %d, %d]; got %s: those blocks are recomputed", B, 2 * D, tuple(t.shape))
                failed(o.block_ids[gi] for o in ops)
                return
            nbytes = t[0].numel() * t.element_size()
            cache = _cos_sin(rope, model.max_positions, t.dtype)
            if t.dtype in _RAW:  # one single-threaded kernel call per layer (see _load_layer)
                raw = _RAW[t.dtype]
                _load_layer(t.view(raw).view(t.shape[0], t.shape[1], -1).numpy(), pool.view(raw).numpy(),
                            layer.offset // t.element_size(), D, slots_np, op_np, src_np, blocks_np, at_np,
                            old_np, new_np, cache.numpy(), rope.rotary_dim, rope.is_neox_style,
                            t.dtype == torch.bfloat16)
                continue
            # a few whole-tensor ops per layer, not a few per token range
            src = pool[slots, layer.offset:layer.offset + nbytes].view(t.dtype).view(len(ops), *t.shape[1:])
            src_k, src_v = kv_views(src)
            dst = t.index_select(0, blocks)
            dst_k, dst_v = kv_views(dst)
            k = rerotate(src_k[op, :, :, src_at], old, new, cache, rope.rotary_dim, rope.is_neox_style)
            dst_k[dst_block, :, :, dst_at] = k  # [tokens, heads, head] into [block, heads, head, offset]
            dst_v[dst_block, :, dst_at] = src_v[op, :, src_at]
            t.index_copy_(0, blocks, dst)
    # vLLM sums the workers' stats, and every tensor-parallel rank loads the same tokens (its own
    # heads of them): the first rank counts them
    tp = tp_group()
    tokens = tp is None or tp.rank_in_group == 0
    if recompute_ratio and len(kv_layers) == 1 and forward_context is not None:
        block_ids = torch.tensor([o.block_ids[0] for o in ops])[op]

        def report(blended: int, recomputed: int) -> None:
            if tokens:
                count({"pic_blended_tokens": blended, "pic_recomputed_tokens": recomputed})

        attach(forward_context, BlendPlan(block_ids * B + dst_at, _run_heads(ops, within), recompute_ratio, B, report))
    count({"pic_loads": len(ops), "pic_seconds": time.perf_counter() - t0, "pic_tokens": len(new) if tokens else 0})


_RAW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}  # dtypes the kernel reads as bits


@numba.njit(nogil=True, cache=True)
def _load_layer(dst, src, first, head_size, slots, op, src_at, dst_block, dst_at, old, new, table,
                rotary_dim, neox, bf16):
    """One layer's loads in one call, straight into the cache: K of each token re-rotated (the
    same float32 arithmetic as `rerotate`, one rounding to the cache's dtype), V copied. `dst`: the
    layer as [blocks, heads, 2 * block * head] bits (int32: float32, int16: bf16), per head K as
    [head, block] then V as [block, head] (`kv_views`), `bf16` says which; `src`: the CPU pool
    as the same bits [slots, ...], this layer from element `first` of each slot. Why a kernel: every torch op
    starts a thread team, which on a busy CPU costs milliseconds (the torch path's ~20 ops per
    layer took 1.3 s for 1,536 tokens x 8 layers under load, 33 ms quiet)."""
    heads, D = dst.shape[1], head_size
    B = dst.shape[2] // (2 * D)
    half = rotary_dim // 2
    x = np.empty(D, np.float32)
    bits = x.view(np.int32)
    for i in range(len(op)):
        slot, a, blk, b, po, pn = slots[op[i]], src_at[i], dst_block[i], dst_at[i], old[i], new[i]
        for h in range(heads):
            at = first + h * 2 * B * D  # this head's K, then its V, in the slot
            for d in range(D):
                raw = np.int32(src[slot, at + d * B + a])
                bits[d] = (raw & 0xFFFF) << 16 if bf16 else raw
            for j in range(half):
                i1, i2 = (j, j + half) if neox else (2 * j, 2 * j + 1)
                c, s = table[po, j], table[po, half + j]
                norm = c * c + s * s
                c, s = c / norm, -s / norm
                u1, u2 = x[i1] * c - x[i2] * s, x[i2] * c + x[i1] * s
                c, s = table[pn, j], table[pn, half + j]
                x[i1], x[i2] = u1 * c - u2 * s, u2 * c + u1 * s
            for d in range(D):
                if bf16:  # round to nearest even, as torch's .to(bfloat16)
                    u = np.int64(bits[d]) & 0xFFFFFFFF
                    dst[blk, h, d * B + b] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
                else:
                    dst[blk, h, d * B + b] = bits[d]
            for d in range(D):
                dst[blk, h, B * D + b * D + d] = src[slot, at + B * D + a * D + d]


def _run_heads(ops: list[PicLoad], within: torch.Tensor) -> torch.Tensor:
    """Per loaded token: among the first RUN_HEAD tokens of its run (ops that continue each other
    at the same position shift form one run)."""
    run_start, at = [], 0  # per op: how many tokens of its run precede it
    for i, o in enumerate(ops):
        p = ops[i - 1] if i else None
        continues = (p is not None and o.new_position == p.new_position + p.count
                     and o.old_position - o.new_position == p.old_position - p.new_position)
        at = at + p.count if p is not None and continues else 0
        run_start.append(at)
    counts = torch.tensor([o.count for o in ops])
    return torch.repeat_interleave(torch.tensor(run_start), counts) + within < RUN_HEAD
