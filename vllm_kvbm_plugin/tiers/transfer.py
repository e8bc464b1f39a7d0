"""The transfer engine: copies between vLLM's KV cache tensors and the CPU pool's slots. Imports
torch, numpy and numba (Triton where installed), never vLLM, so it runs wherever torch does.

A slot holds one entry: the block's bytes of every layer of its kind, one layer after another
(`Layer.offset`). Jobs are lists of (kind, block id per group, slot); `submit` returns a job id and
`get_finished` reports finished jobs in submission order (vLLM's get_finished contract).

- CPU: numba page copies (tiers/copy.py) for vLLM's CPU layout, every layer of a kind in one
  kernel call (per thread), torch index ops for any other; a job is done when `submit` returns.
- CUDA: a job runs on the side stream (`stream`) with an end event (and a start event for its
  time); `get_finished` polls them. Each block of a layer is a few equal contiguous pieces (one
  for blocks on dim 0, K and V for blocks on dim 1, ...), and one Triton launch copies every
  piece of a job, reaching pinned memory through its device address. Stores wait for the
  forward that wrote their blocks (the side stream waits on the current one) and gather them
  into device staging (a snapshot at HBM speed); the current stream waits for that gather, and
  only for it, before anything the model runner queues next (the next step's Mamba state
  copies, block zeroing, forward: any of them may rewrite a block freed since). The rows then
  cross to the pinned slots on a second stream (`d2h`), by the copy engine (long rows: leaves
  the SMs to the forward) or a second launch (short rows), so neither the next forward nor the
  next job's gathers and loads queue behind a long prefill's PCIe transfer. Staging is a few
  buffers, each reused once the transfer that read it has passed (STAGE_LIMIT in all). Loads go
  straight from the slots into the blocks (short rows) or through staging by the copy engine,
  and make the current stream, not the host, wait on their event. Layers whose pieces are tiny
  or misaligned, or a machine without Triton, take the torch path (synchronous).
"""

from __future__ import annotations

import collections
import ctypes
import math
import time
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm_kvbm_plugin.tiers.copy import copy_rows, table_row
from vllm_kvbm_plugin.tiers.host_memory import cudart

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs neither
    triton = tl = None

MIN_PIECE_BYTES = 512  # smaller contiguous pieces (odd strides) take the torch path
DMA_MIN_ROW_BYTES = 512 << 10  # rows at least this long go through staging + the copy engine
STAGE_BYTES = 128 << 20  # one device staging buffer (stores' snapshots, DMA rows), made when needed
STAGE_LIMIT = 1 << 30  # staging in all: stores beyond it in flight wait for earlier transfers
KERNEL_WORDS = 1024  # 8-byte words one program copies per iteration


class Layer:
    """One KV cache tensor as the engine copies it: its block dimension, where its part of a
    slot starts, and how a block's bytes lie in memory."""

    __slots__ = ("tensor", "dim", "offset", "nbytes", "block_shape", "pages", "pieces")

    def __init__(self, tensor: torch.Tensor, dim: int) -> None:
        self.tensor, self.dim, self.offset = tensor, dim, 0
        shape = list(tensor.shape)
        del shape[dim]
        self.block_shape = tuple(shape)
        self.nbytes = tensor[(slice(None),) * dim + (0,)].numel() * tensor.element_size()
        # CPU tensors with blocks on dim 0 (vLLM's CPU layout): whole pages as uint64 words, copied
        # by the numba kernels without temporaries. A page can be longer than the block's data
        # (Mamba state views are padded to the attention page): the padding belongs to the same
        # block, so copying it is harmless.
        self.pages: np.ndarray | None = None
        page = tensor.stride(0) * tensor.element_size() if tensor.dim() else 0
        start = tensor.storage_offset() * tensor.element_size()
        n = tensor.shape[0] if tensor.dim() else 0
        if (tensor.device.type == "cpu" and dim == 0 and page >= self.nbytes and page % 8 == 0
                and start % 8 == 0 and start + n * page <= tensor.untyped_storage().nbytes()):
            flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage(), start, (n * page,), (1,))
            self.pages = flat.numpy().view(np.uint64)
            self.nbytes = page
        self.pieces: tuple[np.ndarray, int] | None = block_pieces(tensor, dim) if tensor.device.type == "cuda" else None

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[self.dim]


def block_pieces(t: torch.Tensor, dim: int) -> tuple[np.ndarray, int] | None:
    """A block's bytes as equal contiguous pieces, in the block's element order (its order in a
    slot): (byte offset of each piece from the block's first element, piece bytes). None when
    the pieces are smaller than MIN_PIECE_BYTES or not 8-byte aligned."""
    e = t.element_size()
    dims = [(n, s) for i, (n, s) in enumerate(zip(t.shape, t.stride())) if i != dim and n != 1]
    if any(s < 0 for _, s in dims) or t.stride(dim) < 0:
        return None
    inner, k = 1, len(dims)
    while k and dims[k - 1][1] == inner:  # the longest contiguous suffix
        inner *= dims[k - 1][0]
        k -= 1
    offsets = np.zeros(1, np.int64)
    for n, s in dims[:k]:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    piece = inner * e
    words = [piece, t.data_ptr(), t.stride(dim) * e]
    if piece < MIN_PIECE_BYTES or any(x % 8 for x in words):
        return None
    return offsets * e, piece


def piece_descriptors(layers: list[tuple[int, Layer]], ids: np.ndarray,
                      rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(KV address, row address, 8-byte words) of every piece of blocks `ids[:, group]` of
    `layers` [(group, layer)], whose entries lie at row addresses `rows` (pool slots or staging
    rows). Int64 arrays, item-major per layer."""
    kv, row, words = [], [], []
    for g, layer in layers:
        assert layer.pieces is not None  # only layers with pieces take the kernel
        offsets, piece = layer.pieces
        t = layer.tensor
        bstride = t.stride(layer.dim) * t.element_size()
        kv.append((t.data_ptr() + ids[:, g, None] * bstride + offsets[None, :]).reshape(-1))
        at = layer.offset + np.arange(len(offsets), dtype=np.int64) * piece
        row.append((rows[:, None] + at[None, :]).reshape(-1))
        words.append(np.full(kv[-1].shape[0], piece // 8, np.int64))
    return np.concatenate(kv), np.concatenate(row), np.concatenate(words)


if triton is not None:
    @triton.jit
    def _copy_pieces(desc, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
        """Piece i: desc[2n + i] words from address desc[i] to desc[n + i]; programs take pieces
        in turn."""
        i = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        while i < n:
            src = tl.load(desc + i).to(tl.pointer_type(tl.int64))
            dst = tl.load(desc + n + i).to(tl.pointer_type(tl.int64))
            words = tl.load(desc + 2 * n + i)
            for start in range(0, words, BLOCK):
                at = start + offs
                mask = at < words
                tl.store(dst + at, tl.load(src + at, mask=mask), mask=mask)
            i += tl.num_programs(0)


def _cudart_memcpy():
    """cudaMemcpyAsync of the CUDA runtime torch loaded (one call per run of rows, no tensor
    views), or None where it is not a shared library of this process."""
    lib = cudart()
    fn = getattr(lib, "cudaMemcpyAsync", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class CudaOps:
    """What the CUDA path asks of the device: its two streams, events, descriptor uploads, the
    kernel and row copies (one object, so tests run the same path on host memory)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # gathers and loads: what the current stream waits for
        self.d2h = torch.cuda.Stream(device)  # stores' rows to the pinned slots: only their reports wait
        self.programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        self.memcpy = _cudart_memcpy()

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def on_side(self) -> torch.cuda.StreamContext:
        return torch.cuda.stream(self.stream)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def launch(self, stream: torch.cuda.Stream, desc: np.ndarray, n: int, keep: list[torch.Tensor]) -> None:
        """Run piece descriptors [src addresses, dst addresses, words] on `stream`."""
        with torch.cuda.stream(stream):
            d = torch.from_numpy(desc).pin_memory().to(self.device, non_blocking=True)
            keep.append(d)  # until the job's end event
            _copy_pieces[(min(n, self.programs),)](d, n, BLOCK=KERNEL_WORDS)

    def copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, dst_at: int, src: torch.Tensor, src_at: int, n: int) -> None:
        """n bytes between device and pinned memory with the copy engine, on `stream`."""
        if self.memcpy is not None:
            rc = self.memcpy(dst.data_ptr() + dst_at, src.data_ptr() + src_at, n, 4,  # cudaMemcpyDefault
                             stream.cuda_stream)
            if rc:
                raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {rc}")
            return
        with torch.cuda.stream(stream):
            dst.view(-1)[dst_at:dst_at + n].copy_(src.view(-1)[src_at:src_at + n], non_blocking=True)


class _Stage:
    """One device staging buffer and the event after its last reader (None: never used)."""

    __slots__ = ("buf", "free", "used")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf, self.used = buf, 0
        self.free: torch.cuda.Event | None = None


class _Job(NamedTuple):
    id: int
    start: torch.cuda.Event
    end: torch.cuda.Event
    keep: list[torch.Tensor]  # tensors the copies read until the end event


class TransferEngine:
    """Stores (KV blocks -> slots) and loads (slots -> KV blocks) of lists of (kind, block id per
    group, slot) between `layers` {kind: [[Layer] per group]} and `pool` [slots, slot bytes].

    CUDA modes: `auto` picks by row length (an entry's bytes in its slot); `kernel` moves rows
    with the kernel (loads straight into the blocks); `dma` with the copy engine through device
    staging. Stores gather their blocks into device staging first (a snapshot at HBM speed), and
    `submit` returns with the current stream ordered after that gather, never after the
    transfer to the host."""

    def __init__(self, layers: dict[Any, list[list[Layer]]], pool: torch.Tensor, mode: str = "auto",
                 ops: CudaOps | None = None) -> None:
        assert mode in ("auto", "kernel", "dma")
        self.layers, self.pool, self.mode = layers, pool, mode
        self.slot_bytes = pool.shape[1]
        self._next = 0
        self._done: collections.deque[tuple[int, float]] = collections.deque()  # CPU: (job, seconds)
        self._inflight: collections.deque[_Job] = collections.deque()  # CUDA
        self._last_load: torch.cuda.Event | None = None  # the last load's end
        device = next((ly.tensor.device for gs in layers.values() for ls in gs for ly in ls
                       if ly.tensor.device.type == "cuda"), None)
        if ops is None and device is not None and triton is not None and pool.is_pinned() and self.slot_bytes % 8 == 0:
            ops = CudaOps(device)
        self.ops, self.cuda = ops, ops is not None
        self._stages: list[_Stage] = []
        self._uses = 0
        self._pool_words = pool.numpy().reshape(-1).view(np.uint64) if not self.cuda else None
        # CPU, per kind: the copy table of its page layers (tiers/copy.py: a job's ids and slots
        # are one matrix, a column per group, then the slots), and the (group, layer) the torch
        # path copies
        self._tables: dict[Any, np.ndarray] = {}
        self._torch_layers: dict[Any, list[tuple[int, Layer]]] = {}
        for kind, groups in layers.items() if not self.cuda else ():  # (page copies address slots in words)
            paged = [(g, ly, ly.pages) for g, ls in enumerate(groups) for ly in ls
                     if ly.pages is not None and ly.offset % 8 == 0 and self.slot_bytes % 8 == 0]
            self._tables[kind] = np.array([table_row(pages, ly.nbytes // 8, ly.offset // 8, g, len(groups))
                                           for g, ly, pages in paged], np.int64).reshape(-1, 7)
            self._torch_layers[kind] = [(g, ly) for g, ls in enumerate(groups) for ly in ls
                                        if all(ly is not p for _, p, _ in paged)]

    # ---- the contract ----------------------------------------------------------------------
    def submit(self, ops: Iterable[tuple[Hashable, Sequence[int], int]], to_pool: bool) -> int:
        """Start copying `ops` [(kind, block ids, slot)] into the pool (store) or out of it (load);
        the job id. Blocks and slots out of range raise IndexError before anything is copied.
        CUDA: the current stream then waits for a load to land, or for a store to have read its
        blocks (whatever it queues next may rewrite them)."""
        job, self._next = self._next, self._next + 1
        by_kind: dict[Hashable, list[tuple[Sequence[int], int]]] = {}
        for kind, ids, slot in ops:
            by_kind.setdefault(kind, []).append((ids, slot))
        if not self.cuda:
            t0 = time.perf_counter()
            self._cpu_copy(by_kind, to_pool)
            self._done.append((job, time.perf_counter() - t0))
            return job
        dev = self.ops
        assert dev is not None  # self.cuda
        current = dev.current()
        dev.stream.wait_stream(current)  # stores read what the forward wrote; loads land after it
        start, end = dev.event(), dev.event()
        keep: list[torch.Tensor] = []
        start.record(dev.stream)
        with dev.on_side():  # the torch path's copies
            for kind, items in by_kind.items():
                self._cuda_copy(kind, items, to_pool, keep)
        if to_pool:
            read = dev.event()
            read.record(dev.stream)  # the blocks are read: gathered into staging, or copied out
            current.wait_event(read)
            dev.d2h.wait_stream(dev.stream)
            end.record(dev.d2h)
        else:
            end.record(dev.stream)
            current.wait_event(end)  # the forward reads the blocks only once they landed
            self._last_load = end
        self._inflight.append(_Job(job, start, end, keep))
        return job

    def get_finished(self) -> list[tuple[int, float]]:
        """(job id, seconds it took) of the jobs finished since the last call, in submission order."""
        out = list(self._done)
        self._done.clear()
        while self._inflight and self._inflight[0].end.query():
            j = self._inflight.popleft()
            out.append((j.id, j.start.elapsed_time(j.end) / 1e3))
        return out

    def wait(self) -> None:
        """The host waits until every job submitted so far is done (they are still reported)."""
        for j in list(self._inflight):
            j.end.synchronize()

    def wait_loads(self) -> None:
        """The host waits for the loads submitted so far: before it writes pool slots they read."""
        if self._last_load is not None:
            self._last_load.synchronize()

    # ---- CPU -------------------------------------------------------------------------------
    def _cpu_copy(self, by_kind: dict[Hashable, list[tuple[Sequence[int], int]]], to_pool: bool) -> None:
        """Per kind, its page layers in one `copy_rows` job (one kernel call per thread: a small
        block costs a memcpy), checked before a byte moves; then the torch copies, on this thread
        (torch ops from a helper thread would start a second OpenMP team)."""
        for kind, items in by_kind.items():
            table = self._tables[kind]
            if len(table):
                assert self._pool_words is not None  # the CPU path
                cols = np.array([(*ids, slot) for ids, slot in items], np.int64)
                copy_rows(table, cols, self._pool_words, self.slot_bytes // 8, to_pool)
            slots = [s for _, s in items]
            for gi, layer in self._torch_layers[kind]:
                block_ids = [ids[gi] for ids, _ in items]
                (layer_to_slots if to_pool else slots_to_layer)(layer, block_ids, slots, self.pool)

    # ---- CUDA ------------------------------------------------------------------------------
    def _cuda_copy(self, kind: Hashable, items: list[tuple[Sequence[int], int]], to_pool: bool,
                   keep: list[torch.Tensor]) -> None:
        ids = np.asarray([i for i, _ in items], np.int64).reshape(len(items), -1)
        slots = np.asarray([s for _, s in items], np.int64)
        fast: list[tuple[int, Layer]] = []
        slow: list[tuple[int, Layer]] = []
        for g, layers in enumerate(self.layers[kind]):
            for layer in layers:
                (fast if layer.pieces is not None and layer.offset % 8 == 0 else slow).append((g, layer))
        for g, layer in fast:
            if ids[:, g].min() < 0 or ids[:, g].max() >= layer.num_blocks:
                raise IndexError("block id out of range")
        if slots.min() < 0 or slots.max() >= self.pool.shape[0]:
            raise IndexError("slot out of range")
        for g, layer in slow:  # synchronous
            (layer_to_slots if to_pool else slots_to_layer)(layer, ids[:, g].tolist(), slots.tolist(), self.pool)
        if not fast:
            return
        dev = self.ops
        assert dev is not None  # the CUDA path
        width = max(layer.offset + layer.nbytes for _, layer in fast)
        dma = self.mode == "dma" or (self.mode == "auto" and width >= DMA_MIN_ROW_BYTES)
        pool_rows = self.pool.data_ptr() + slots * self.slot_bytes
        # whole rows cross only when the fast layers fill them (else they would overwrite the
        # slow layers' bytes); loads by kernel need no staging
        if slow or not (to_pool or dma):
            kv, row, words = piece_descriptors(fast, ids, pool_rows)
            self._launch(dev.stream, *((kv, row) if to_pool else (row, kv)), words, keep)
            return
        order = np.argsort(slots, kind="stable")  # consecutive slots -> consecutive staging rows
        c = 0
        while c < len(order):
            stage = self._stage(width, dev.stream)
            part = order[c:c + stage.buf.numel() // width]
            c += len(part)
            rows = stage.buf.data_ptr() + np.arange(len(part), dtype=np.int64) * width
            kv, row, words = piece_descriptors(fast, ids[part], rows)
            if to_pool:  # gather on the side stream (after any load there that reads these slots),
                # cross to the host on d2h
                self._launch(dev.stream, kv, row, words, keep)
                gathered = dev.event()
                gathered.record(dev.stream)
                dev.d2h.wait_event(gathered)
                if dma:
                    self._move_rows(dev.d2h, slots[part], stage.buf, width, True)
                else:  # staging rows -> pool rows, one piece each
                    self._launch(dev.d2h, rows, pool_rows[part], np.full(len(part), width // 8, np.int64), keep)
                moved = dev.d2h
            else:  # pool rows -> staging by the copy engine, then the scatter
                self._move_rows(dev.stream, slots[part], stage.buf, width, False)
                self._launch(dev.stream, row, kv, words, keep)
                moved = dev.stream
            stage.free = free = dev.event()
            free.record(moved)

    def _launch(self, stream: torch.cuda.Stream, src: np.ndarray, dst: np.ndarray, words: np.ndarray,
                keep: list[torch.Tensor]) -> None:
        assert self.ops is not None  # the CUDA path
        if len(src):
            self.ops.launch(stream, np.concatenate([src, dst, words]), len(src), keep)

    def _stage(self, width: int, stream: torch.cuda.Stream) -> _Stage:
        """A staging buffer for rows of `width` bytes: a free one, else a new one while staging
        stays within STAGE_LIMIT, else the least recently used, once `stream` has waited for
        the transfer that last read it (the only way a gather waits for a PCIe transfer)."""
        fits = [s for s in self._stages if s.buf.numel() >= width]
        free = [s for s in fits if s.free is None or s.free.query()]
        size = max(STAGE_BYTES, width)
        assert self.ops is not None  # the CUDA path
        if free:
            stage = free[0]
        elif not fits or sum(s.buf.numel() for s in self._stages) + size <= STAGE_LIMIT:
            stage = _Stage(self.ops.empty(size))
            self._stages.append(stage)
        else:
            stage = min(fits, key=lambda s: s.used)
            assert stage.free is not None  # none free: each has been used
            stream.wait_event(stage.free)
        self._uses += 1
        stage.used = self._uses
        return stage

    def _move_rows(self, stream: torch.cuda.Stream, slots: np.ndarray, stage: torch.Tensor, width: int, to_pool: bool) -> None:
        """Staging rows 0.. <-> the pool rows of `slots` (sorted) with the copy engine on `stream`:
        one copy per run of consecutive slots when an entry fills its slot, else one per row."""
        if width == self.slot_bytes:
            cut = np.flatnonzero(np.diff(slots) != 1) + 1
            starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [len(slots)]])
        else:
            starts, ends = np.arange(len(slots)), np.arange(1, len(slots) + 1)
        assert self.ops is not None  # the CUDA path
        for a, b in zip(starts.tolist(), ends.tolist()):
            pool_at, stage_at, n = int(slots[a]) * self.slot_bytes, a * width, (b - a) * width
            if to_pool:
                self.ops.copy(stream, self.pool, pool_at, stage, stage_at, n)
            else:
                self.ops.copy(stream, stage, stage_at, self.pool, pool_at, n)


# ---- the torch path (odd layouts, CUDA without Triton, direct loads' scratch slot) ---------------
def layer_to_slots(layer: Layer, block_ids: list[int], slots: list[int], pool: torch.Tensor) -> None:
    ids = torch.tensor(block_ids, dtype=torch.long, device=layer.tensor.device)
    data = layer.tensor.index_select(layer.dim, ids).movedim(layer.dim, 0)
    data = data.reshape(len(block_ids), -1).view(torch.uint8).cpu()
    pool[torch.tensor(slots, dtype=torch.long), layer.offset:layer.offset + data.shape[1]] = data


def slots_to_layer(layer: Layer, block_ids: list[int], slots: list[int], pool: torch.Tensor) -> None:
    t = layer.tensor
    n = math.prod(layer.block_shape) * t.element_size()  # a block's data (a padded page's padding stays)
    data = pool[torch.tensor(slots, dtype=torch.long), layer.offset:layer.offset + n]
    data = data.view(t.dtype).reshape(len(block_ids), *layer.block_shape).to(t.device, non_blocking=True)
    t.index_copy_(layer.dim, torch.tensor(block_ids, dtype=torch.long, device=t.device), data.movedim(0, layer.dim))

