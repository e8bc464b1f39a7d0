"""numba copies between vLLM's CPU KV tensors and the CPU pool: one pass per block and layer, no
temporaries (torch's gather-then-scatter copies every byte twice), blocks spread over threads.

Both sides are flat uint64 arrays (block byte sizes are multiples of 8): a layer holds `w` words
per block, a pool slot `total` words, the layer's part of a slot starts at word `offset`.

Speed: stores into the pool and large loads use non-temporal (streaming) stores, as libc's
memcpy does past its threshold (so torch's copy of one big buffer does): a regular store first
reads the destination line, a third of a copy's memory traffic. Small loads use memcpy and leave
the blocks in cache for the forward. One thread does not saturate memory either, so `copy_pages`
splits the blocks over a small persistent pool of plain Python threads running the nogil
kernels. Not numba's `parallel=True`: its OpenMP layer changed the thread count vLLM's CPU
attention checks in worker processes.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

MAX_THREADS = 4  # memory bandwidth is saturated well before this on common machines
MIN_SPLIT_BYTES = 1 << 20  # below this a thread hand-off costs more than it saves
STREAM_MIN_BYTES = 4 << 20  # a load at least this large would not stay in cache anyway


def _is_words(a) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.uint64 and a.ndim == 1 and a.layout == "C"


@intrinsic
def _memcpy(typingctx, dst, src):
    """dst[:len(src)] = src with libc memcpy (numba's slice assignment is an element loop at about
    2/3 of its speed); the caller guarantees len(dst) >= len(src)."""
    if not (_is_words(dst) and _is_words(src)):
        return None

    def codegen(context, builder, sig, args):
        d = context.make_array(sig.args[0])(context, builder, args[0])
        s = context.make_array(sig.args[1])(context, builder, args[1])
        cgutils.raw_memcpy(builder, d.data, s.data, s.nitems, s.itemsize)
        return context.get_dummy_value()

    return types.void(dst, src), codegen


@intrinsic
def _stream_line(typingctx, dst, di, src, si):
    """dst[di:di+8] = src[si:si+8] as one 64-byte non-temporal store; dst+di is 64-byte aligned."""
    if not (_is_words(dst) and _is_words(src)):
        return None

    def codegen(context, builder, sig, args):
        d = context.make_array(sig.args[0])(context, builder, args[0])
        s = context.make_array(sig.args[2])(context, builder, args[2])
        line = ir.VectorType(ir.IntType(64), 8)
        v = builder.load(builder.bitcast(builder.gep(s.data, [args[3]]), line.as_pointer()), align=8)
        st = builder.store(v, builder.bitcast(builder.gep(d.data, [args[1]]), line.as_pointer()), align=64)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.void(dst, types.intp, src, types.intp), codegen


@intrinsic
def _fence(typingctx):
    """Order the weakly ordered streaming stores before whatever the thread does next."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(cache=True, nogil=True)
def _copy_words(dst, a, src, b, w, stream):
    """dst[a:a+w] = src[b:b+w], bounds checked (the kernels get raw ids from the plan)."""
    if a < 0 or b < 0 or a + w > dst.shape[0] or b + w > src.shape[0]:
        raise IndexError("block id or slot out of range")
    if not stream:
        _memcpy(dst[a : a + w], src[b : b + w])
        return
    addr = np.int64(dst.ctypes.data) + a * 8  # (signed: numba's mixed int64/uint64 math is float)
    k = min(w, (64 - addr % 64) % 64 // 8)  # words up to a line boundary
    for j in range(k):
        dst[a + j] = src[b + j]
    while k + 8 <= w:
        _stream_line(dst, a + k, src, b + k)
        k += 8
    for j in range(k, w):
        dst[a + j] = src[b + j]


@numba.njit(cache=True, nogil=True)
def rows_to_slots(src, w, block_ids, dst, total, slots, offset, stream=False):
    """Slot slots[i] words [offset, offset+w) <- block block_ids[i] of the layer."""
    for i in range(block_ids.shape[0]):
        _copy_words(dst, slots[i] * total + offset, src, block_ids[i] * w, w, stream)
    if stream:
        _fence()


@numba.njit(cache=True, nogil=True)
def slots_to_rows(src, total, slots, offset, dst, w, block_ids, stream=False):
    """Block block_ids[i] of the layer <- slot slots[i] words [offset, offset+w)."""
    for i in range(block_ids.shape[0]):
        _copy_words(dst, block_ids[i] * w, src, slots[i] * total + offset, w, stream)
    if stream:
        _fence()


_pool: ThreadPoolExecutor | None = None
_threads: int | None = None  # decided at the first use
_pool_lock = threading.Lock()


def helpers() -> tuple[ThreadPoolExecutor | None, int]:
    """The shared helper pool (also used by the disk tier) and how many threads a task may use,
    the caller's included. Sized by the caller's CPU affinity, which helpers inherit: a thread
    pinned to one core gets no helpers."""
    global _pool, _threads
    with _pool_lock:
        if _threads is None:
            try:
                cpus = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                cpus = os.cpu_count() or 1
            _threads = max(1, min(MAX_THREADS, cpus))
            if _threads > 1:
                _pool = ThreadPoolExecutor(_threads - 1, thread_name_prefix="kvbm-helper")
        return _pool, _threads


def _forget_helpers() -> None:
    """A forked child has none of the parent's threads: let it start its own."""
    global _pool, _threads, _pool_lock
    _pool, _threads, _pool_lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def run_or_cancel(future, fn, *args):
    """The result of `future`, or fn(*args) on this thread when no helper has started it yet (the
    helpers may be busy with another thread's copy: never wait behind them)."""
    if future is None or future.cancel():
        return fn(*args)
    return future.result()


def _run_part(jobs, pool_words, total, to_pool, stream, part, parts) -> None:
    """Part `part` of `parts` of every job: a contiguous share of its blocks."""
    for pages, w, offset, ids, slots in jobs:
        a, b = ids.shape[0] * part // parts, ids.shape[0] * (part + 1) // parts
        if to_pool:
            rows_to_slots(pages, w, ids[a:b], pool_words, total, slots[a:b], offset, stream)
        else:
            slots_to_rows(pool_words, total, slots[a:b], offset, pages, w, ids[a:b], stream)


def copy_pages(jobs: list, pool_words: np.ndarray, total: int, to_pool: bool, threads: int | None = None,
               stream: bool | None = None) -> None:
    """Run page copies `jobs` = [(layer pages, w, offset, block ids, slots)] (int64 ids and slots).
    Streaming stores by default for stores into the pool (read back only much later) and for large
    loads. The blocks are cut in a few chunks per thread that the caller's thread and the helpers
    take in turn: a helper that starts late (vLLM's OpenMP threads still spin after the forward)
    just takes fewer. Returns only when every chunk is done, also when one failed (then raises)."""
    if not jobs:
        return
    nbytes = sum(8 * w * ids.shape[0] for _, w, _, ids, _ in jobs)
    if stream is None:
        stream = to_pool or nbytes >= STREAM_MIN_BYTES
    pool, avail = helpers()
    threads = avail if threads is None else threads
    most = max(job[3].shape[0] for job in jobs)
    chunks = min(4 * threads, most, nbytes // MIN_SPLIT_BYTES)
    if pool is None or threads <= 1 or chunks <= 1:
        _run_part(jobs, pool_words, total, to_pool, stream, 0, 1)
        return
    next_chunk = itertools.count().__next__  # atomic under the GIL

    def work() -> None:
        while (c := next_chunk()) < chunks:
            _run_part(jobs, pool_words, total, to_pool, stream, c, chunks)

    futures = [pool.submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        for f in futures:
            f.cancel()  # not started yet: nothing left for it
        wait(futures)  # never return while a helper still writes
    for f in futures:
        if not f.cancelled():
            f.result()
