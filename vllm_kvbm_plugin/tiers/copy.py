"""numba copies between vLLM's CPU KV tensors and the CPU pool: one pass per block and layer, no
temporaries (torch's gather-then-scatter copies every byte twice), blocks spread over threads.

Both sides are flat uint64 arrays (block byte sizes are multiples of 8): a layer holds `w` words
per block, a pool slot `total` words, the layer's part of a slot starts at word `offset`.

One kernel call copies a whole job (every block of every layer, `copy_table`): a job is a table
of rows (one per layer and group: the layer's address, words per block, offset in the slot, block
count, and the range of the job's block ids and slots it copies), checked in full before any
byte moves. Small blocks then cost a memcpy each, not a Python-level call per layer.

Speed: stores into the pool and large loads use non-temporal (streaming) stores, as libc's
memcpy does past its threshold (so torch's copy of one big buffer does): a regular store first
reads the destination line, a third of a copy's memory traffic. Small loads use memcpy and leave
the blocks in cache for the forward. One thread does not saturate memory either, so `copy_table`
splits the pieces over a small persistent pool of plain Python threads running the nogil
kernel. Not numba's `parallel=True`: its OpenMP layer changed the thread count vLLM's CPU
attention checks in worker processes.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

MAX_THREADS = 4  # memory bandwidth is saturated well before this on common machines
MIN_SPLIT_BYTES = 1 << 20  # below this a thread hand-off costs more than it saves
STREAM_MIN_BYTES = 4 << 20  # a load at least this large would not stay in cache anyway

# columns of a copy table (int64), one row per layer: its pages' address, words per block, its part's
# word offset in a slot, its block count; the job's columns with its block ids and its slots; how
# many of the job's rows it copies (-1: all)
ADDR, WORDS, OFFSET, BLOCKS, ID_COL, SLOT_COL, COUNT = range(7)

# a page copy of `copy_pages`: (layer pages, words per block, word offset in a slot, block ids, slots)
PageCopy = tuple[np.ndarray, int, int, Sequence[int] | np.ndarray, Sequence[int] | np.ndarray]


def _ptr(builder, addr):
    return builder.inttoptr(addr, ir.IntType(8).as_pointer())


@intrinsic
def _memcpy_at(typingctx, dst, src, nbytes):
    """libc memcpy of `nbytes` from address `src` to address `dst` (numba's slice assignment is an
    element loop at about 2/3 of its speed); the caller checked both ranges."""
    if not all(isinstance(a, types.Integer) for a in (dst, src, nbytes)):
        return None

    def codegen(context, builder, sig, args):
        cgutils.raw_memcpy(builder, _ptr(builder, args[0]), _ptr(builder, args[1]), args[2], 1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def _stream_line_at(typingctx, dst, src):
    """The 64 bytes at address `src` to address `dst` (64-byte aligned) as one non-temporal store."""
    if not all(isinstance(a, types.Integer) for a in (dst, src)):
        return None

    def codegen(context, builder, sig, args):
        line = ir.VectorType(ir.IntType(64), 8).as_pointer()
        v = builder.load(builder.bitcast(_ptr(builder, args[1]), line), align=8)
        st = builder.store(v, builder.bitcast(_ptr(builder, args[0]), line), align=64)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def _fence(typingctx):
    """Order the weakly ordered streaming stores before whatever the thread does next."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(cache=True, nogil=True)
def _copy_at(dst: int, src: int, nbytes: int, stream: bool) -> None:
    """nbytes (a multiple of 8) from address src to address dst, both 8-byte aligned; streaming:
    memcpy up to dst's next 64-byte line, whole lines non-temporal, memcpy for the tail."""
    if not stream:
        _memcpy_at(dst, src, nbytes)
        return
    k = min(nbytes, (64 - dst % 64) % 64)
    if k:
        _memcpy_at(dst, src, k)
    while k + 64 <= nbytes:
        _stream_line_at(dst + k, src + k)
        k += 64
    if k < nbytes:
        _memcpy_at(dst + k, src + k, nbytes - k)


@numba.njit(cache=True, nogil=True)
def _copy_words(dst: np.ndarray, a: int, src: np.ndarray, b: int, w: int, stream: bool) -> None:
    """dst[a:a+w] = src[b:b+w], bounds checked."""
    if a < 0 or b < 0 or a + w > dst.shape[0] or b + w > src.shape[0]:
        raise IndexError("block id or slot out of range")
    # (signed addresses: numba's mixed int64/uint64 math is float)
    _copy_at(np.int64(dst.ctypes.data) + a * 8, np.int64(src.ctypes.data) + b * 8, w * 8, stream)


@numba.njit(cache=True, nogil=True)
def rows_to_slots(src: np.ndarray, w: int, block_ids: np.ndarray, dst: np.ndarray, total: int, slots: np.ndarray,
                  offset: int, stream: bool = False) -> None:
    """Slot slots[i] words [offset, offset+w) <- block block_ids[i] of the layer."""
    for i in range(block_ids.shape[0]):
        _copy_words(dst, slots[i] * total + offset, src, block_ids[i] * w, w, stream)
    if stream:
        _fence()


@numba.njit(cache=True, nogil=True)
def slots_to_rows(src: np.ndarray, total: int, slots: np.ndarray, offset: int, dst: np.ndarray, w: int,
                  block_ids: np.ndarray, stream: bool = False) -> None:
    """Block block_ids[i] of the layer <- slot slots[i] words [offset, offset+w)."""
    for i in range(block_ids.shape[0]):
        _copy_words(dst, block_ids[i] * w, src, slots[i] * total + offset, w, stream)
    if stream:
        _fence()


@numba.njit(cache=True, nogil=True)
def _count(table: np.ndarray, r: int, cols: np.ndarray) -> int:
    return cols.shape[0] if table[r, COUNT] < 0 else table[r, COUNT]


@numba.njit(cache=True, nogil=True)
def check_table(table: np.ndarray, cols: np.ndarray, pool: np.ndarray, total: int) -> tuple[int, int]:
    """IndexError unless every row fits a slot and every piece names a block of its layer and a
    slot of the pool: run before any byte of the job moves. (pieces, bytes) of the job."""
    n_slots = pool.shape[0] // total
    pieces = nbytes = 0
    for r in range(table.shape[0]):
        w, blocks, ic, sc = table[r, WORDS], table[r, BLOCKS], table[r, ID_COL], table[r, SLOT_COL]
        if w <= 0 or table[r, OFFSET] < 0 or table[r, OFFSET] + w > total:
            raise IndexError("a layer's part does not fit the slot")
        n = _count(table, r, cols)
        if not (0 <= ic < cols.shape[1] and 0 <= sc < cols.shape[1] and n <= cols.shape[0]):
            raise IndexError("a row names columns or pieces the job does not have")
        for k in range(n):
            if cols[k, ic] < 0 or cols[k, ic] >= blocks:
                raise IndexError("block id out of range")
            if cols[k, sc] < 0 or cols[k, sc] >= n_slots:
                raise IndexError("slot out of range")
        pieces += n
        nbytes += n * w * 8
    return pieces, nbytes


@numba.njit(cache=True, nogil=True)
def copy_table(table: np.ndarray, cols: np.ndarray, pool: np.ndarray, total: int, lo: int, hi: int, to_pool: bool,
               stream: bool) -> None:
    """Pieces lo..hi (rows in order, piece k of a row: the row's block cols[k, ID_COL] and slot
    cols[k, SLOT_COL]) of a checked job: the layer's block <-> the row's part of the slot."""
    base = np.int64(pool.ctypes.data)
    first = 0
    for r in range(table.shape[0]):
        n = _count(table, r, cols)
        a, b = max(lo - first, 0), min(hi - first, n)
        first += n
        nbytes, ic, sc = table[r, WORDS] * 8, table[r, ID_COL], table[r, SLOT_COL]
        for k in range(a, b):
            kv = table[r, ADDR] + cols[k, ic] * nbytes
            row = base + (cols[k, sc] * total + table[r, OFFSET]) * 8
            if to_pool:
                _copy_at(row, kv, nbytes, stream)
            else:
                _copy_at(kv, row, nbytes, stream)
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


def run_or_cancel(future: Future[Any] | None, fn: Callable[..., Any], *args: Any) -> Any:
    """The result of `future`, or fn(*args) on this thread when no helper has started it yet (the
    helpers may be busy with another thread's copy: never wait behind them)."""
    if future is None or future.cancel():
        return fn(*args)
    return future.result()


def words_of(a: np.ndarray, what: str) -> np.ndarray:
    """`a` itself when it is a flat C-contiguous uint64 array (the kernels use raw addresses into
    it), else TypeError."""
    if not (isinstance(a, np.ndarray) and a.dtype == np.uint64 and a.ndim == 1 and a.flags.c_contiguous):
        raise TypeError(f"{what}: a flat C-contiguous uint64 array is needed")
    return a


def table_row(pages: np.ndarray, w: int, offset: int, id_col: int, slot_col: int, count: int = -1) -> list[int]:
    """A copy table row for a layer's `pages` (w words per block, its part at word `offset` of a
    slot). The caller keeps `pages` alive while the row is used."""
    words_of(pages, "layer pages")
    return [pages.ctypes.data, w, offset, pages.shape[0] // w, id_col, slot_col, count]


def _run_part(table: np.ndarray, cols: np.ndarray, pool_words: np.ndarray, total: int, to_pool: bool, stream: bool,
              part: int, parts: int, pieces: int) -> None:
    """Part `part` of `parts` of the job: a contiguous share of its pieces."""
    copy_table(table, cols, pool_words, total, pieces * part // parts, pieces * (part + 1) // parts, to_pool, stream)


def copy_rows(table: np.ndarray, cols: np.ndarray, pool_words: np.ndarray, total: int, to_pool: bool,
              threads: int | None = None, stream: bool | None = None) -> None:
    """Run one job: `table` (int64 rows, `table_row`) over `cols` (int64 [pieces, columns]: block
    ids and slots), into the pool (`to_pool`) or out of it: one kernel call per thread. Checked in
    full first (IndexError: nothing copied). Streaming stores by default for stores into the pool
    (read back only much later) and for large loads. The pieces are cut in a few chunks per thread
    that the caller's thread and the helpers take in turn: a helper that starts late (vLLM's
    OpenMP threads still spin after the forward) just takes fewer. Returns only when every chunk
    is done, also when one failed (then raises)."""
    words_of(pool_words, "the pool")
    if not (isinstance(table, np.ndarray) and isinstance(cols, np.ndarray) and table.dtype == cols.dtype == np.int64
            and table.ndim == cols.ndim == 2 and table.shape[1] == COUNT + 1):
        raise TypeError(f"a copy job needs an int64 table of {COUNT + 1} columns and int64 [pieces, columns] ids")
    pieces, nbytes = check_table(table, cols, pool_words, total)
    if not pieces:
        return
    if stream is None:
        stream = to_pool or nbytes >= STREAM_MIN_BYTES
    pool, avail = helpers()
    threads = avail if threads is None else threads
    chunks = min(4 * threads, pieces, nbytes // MIN_SPLIT_BYTES)
    args = (table, cols, pool_words, total, to_pool, stream)
    if pool is None or threads <= 1 or chunks <= 1:
        _run_part(*args, 0, 1, pieces)
        return
    next_chunk = itertools.count().__next__  # atomic under the GIL

    def work() -> None:
        while (c := next_chunk()) < chunks:
            _run_part(*args, c, chunks, pieces)

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


def copy_pages(jobs: Sequence[PageCopy], pool_words: np.ndarray, total: int, to_pool: bool, threads: int | None = None,
               stream: bool | None = None) -> None:
    """Page copies `jobs` = [(layer pages, w, offset, block ids, slots)] as one `copy_rows` job
    (job j's ids and slots in columns 2j and 2j + 1)."""
    if not jobs:
        return
    if any(len(ids) != len(slots) for _, _, _, ids, slots in jobs):
        raise ValueError("a page copy needs one slot per block id")
    cols = np.zeros((max(len(ids) for _, _, _, ids, _ in jobs), 2 * len(jobs)), np.int64)
    for j, (_, _, _, ids, slots) in enumerate(jobs):
        cols[:len(ids), 2 * j], cols[:len(ids), 2 * j + 1] = ids, slots
    table = np.array([table_row(pages, w, offset, 2 * j, 2 * j + 1, len(ids))
                      for j, (pages, w, offset, ids, _) in enumerate(jobs)], np.int64)
    copy_rows(table, cols, pool_words, total, to_pool, threads, stream)
