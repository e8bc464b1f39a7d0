"""KVBMConnector, worker side: the CPU pool, copies against vLLM's KV tensors, disk I/O.

Each block is one contiguous pool slot: the block's bytes of every layer, one after another, so a
copy moves whole slots and a disk file is a slot. Copies are batched per layer with
index_select / index_copy_ over all blocks of a step. Disk writes run on a background thread
from slots the scheduler keeps pinned until the write is reported; disk reads (prefetches) are
verified before their bytes reach a slot.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch

from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.layout import key_root, rank_dir, tensor_fingerprint
from vllm_kvbm_plugin.connector.metadata import KVBMMetadata, KVBMWorkerMetadata
from vllm_kvbm_plugin.connector.stats import KVBMStats
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import disk as diskfmt
from vllm_kvbm_plugin.tiers.copy import rows_to_slots, slots_to_rows

logger = get_logger("connector.worker")


class _Layer:
    __slots__ = ("tensor", "dim", "offset", "nbytes", "block_shape", "rows")

    def __init__(self, tensor: torch.Tensor, dim: int, offset: int):
        self.tensor, self.dim, self.offset = tensor, dim, offset
        shape = list(tensor.shape)
        del shape[dim]
        self.block_shape = tuple(shape)
        self.nbytes = tensor[(slice(None),) * dim + (0,)].numel() * tensor.element_size()
        # CPU tensors with blocks on dim 0 (vLLM's CPU attention layout): a uint8 row per block,
        # copied by the numba kernels without temporaries
        self.rows = None
        if tensor.device.type == "cpu" and dim == 0 and tensor.is_contiguous() and self.nbytes % 8 == 0:
            self.rows = tensor.view(torch.uint8).reshape(-1).numpy().view(np.uint64)


class WorkerSide:
    def __init__(self, vllm_config, kv_cache_config, cfg: KVBMConfig):
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        n_layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
        # the same slot count the scheduler side computes
        self.num_slots = cfg.cpu_bytes_to_use // (spec.page_size_bytes * n_layers)
        hbs = kv_cache_config.hash_block_size or spec.block_size
        self.root = key_root(vllm_config, kv_cache_config, hbs)
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            self.rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - not initialised in some test harnesses
            self.rank = 0
        self.disk_base = rank_dir(cfg.disk_path, self.root, self.rank) if cfg.disk_path else None
        self.layers: list[_Layer] = []
        self.pool: torch.Tensor | None = None
        self.report = KVBMWorkerMetadata()
        self._disk_results: queue.SimpleQueue = queue.SimpleQueue()
        self._disk_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._disk_broken = False
        self.stats = KVBMStats()
        self._stats_lock = threading.Lock()  # the disk writer thread records too

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.kv_cache_config.num_blocks
        offset = 0
        described = []
        for name in sorted(kv_caches):
            t = kv_caches[name]
            dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"KVBMConnector: cannot find the block dimension of {name} {tuple(t.shape)}")
            layer = _Layer(t, dims[0], offset)
            offset += layer.nbytes
            self.layers.append(layer)
            described.append((name, layer.block_shape, str(t.dtype), layer.dim))
        self.block_bytes = offset
        self.fingerprint = tensor_fingerprint(self.root, described)
        pin = torch.cuda.is_available()
        self.pool = torch.empty((self.num_slots, offset), dtype=torch.uint8, pin_memory=pin)
        self._word_rows = all(layer.rows is not None for layer in self.layers)
        self._pool_words = self.pool.numpy().reshape(-1).view(np.uint64) if self._word_rows else None
        logger.info("KVBMConnector worker: %d layers, %d bytes per block, CPU pool %d slots (%.1f MiB)%s",
                    len(self.layers), offset, self.num_slots, self.pool.numel() / 2**20,
                    ", pinned" if pin else "")

    # ---- copies ----------------------------------------------------------------------------
    def _to_slots(self, block_ids: list[int], slots: list[int]) -> None:
        if self._word_rows:
            ids, sl, pool = np.asarray(block_ids, np.int64), np.asarray(slots, np.int64), self._pool_words
            for layer in self.layers:
                rows_to_slots(layer.rows, layer.nbytes // 8, ids, pool, self.block_bytes // 8, sl,
                              layer.offset // 8)
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].tensor.device)
        sl = torch.tensor(slots, dtype=torch.long)
        for layer in self.layers:
            data = layer.tensor.index_select(layer.dim, ids).movedim(layer.dim, 0)
            data = data.reshape(len(block_ids), -1).view(torch.uint8).cpu()
            self.pool[sl, layer.offset : layer.offset + layer.nbytes] = data

    def _from_slots(self, block_ids: list[int], slots: list[int]) -> None:
        if self._word_rows:
            ids, sl, pool = np.asarray(block_ids, np.int64), np.asarray(slots, np.int64), self._pool_words
            for layer in self.layers:
                slots_to_rows(pool, self.block_bytes // 8, sl, layer.offset // 8, layer.rows,
                              layer.nbytes // 8, ids)
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].tensor.device)
        sl = torch.tensor(slots, dtype=torch.long)
        for layer in self.layers:
            t = layer.tensor
            data = self.pool[sl, layer.offset : layer.offset + layer.nbytes].view(t.dtype)
            data = data.reshape(len(block_ids), *layer.block_shape).to(t.device, non_blocking=True)
            t.index_copy_(layer.dim, ids, data.movedim(0, layer.dim))

    # ---- connector hooks -------------------------------------------------------------------
    def _record(self, tier: str, direction: str, blocks: int, t0: float) -> None:
        with self._stats_lock:
            self.stats.record(tier, direction, blocks, blocks * self.block_bytes, time.perf_counter() - t0)

    def _failed(self, operation: str) -> None:
        with self._stats_lock:
            self.stats.failure(operation)

    def get_stats(self) -> KVBMStats | None:
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, KVBMStats()
            return stats

    def start_load_kv(self, meta: KVBMMetadata) -> None:
        for key, slot in meta.prefetches:
            t0 = time.perf_counter()
            if self._read_block(key, slot):
                self.report.prefetched.append(key)
                self._record("disk", "read", 1, t0)
            else:
                self.report.prefetch_failed.append(key)
                self._failed("read")
        if meta.loads:
            t0 = time.perf_counter()
            self._from_slots([b for b, _ in meta.loads], [s for _, s in meta.loads])
            self._record("cpu", "load", len(meta.loads), t0)

    def wait_for_save(self, meta: KVBMMetadata) -> None:
        if meta.stores:
            t0 = time.perf_counter()
            self._to_slots([b for _, b, _ in meta.stores], [s for _, _, s in meta.stores])
            self._record("cpu", "store", len(meta.stores), t0)
            self.report.stored += [k for k, _, _ in meta.stores]
        for key, slot, blob in meta.disk_writes:
            self._submit_write(key, slot, blob)

    def build_worker_meta(self) -> KVBMWorkerMetadata | None:
        while True:
            try:
                key, ok = self._disk_results.get_nowait()
            except queue.Empty:
                break
            (self.report.disk_written if ok else self.report.disk_failed).append(key)
        report, self.report = self.report, KVBMWorkerMetadata()
        return report if any(getattr(report, f) for f in report.__dataclass_fields__) else None

    # ---- disk ------------------------------------------------------------------------------
    def _read_block(self, key, slot: int) -> bool:
        """Read and verify a block file straight into its (not yet ready) pool slot."""
        path = diskfmt.block_path(self.disk_base, key)
        return diskfmt.read_into(path, key, self.fingerprint, self.pool[slot].numpy()) is not None

    def _submit_write(self, key, slot: int, blob: bytes) -> None:
        if self._disk_broken:
            self._disk_results.put((key, False))
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kvbm-disk-writer", daemon=True)
            self._writer.start()
        self._disk_jobs.put((key, slot, blob))

    def _write_loop(self) -> None:
        while True:
            job = self._disk_jobs.get()
            if job is None:
                return
            key, slot, blob = job
            ok = False
            t0 = time.perf_counter()
            if not self._disk_broken:
                try:
                    payload = self.pool[slot].numpy()  # pinned by the scheduler until reported
                    diskfmt.write_atomic(diskfmt.block_path(self.disk_base, key),
                                         diskfmt.encode(key, self.fingerprint, payload, blob),
                                         fsync=self.cfg.disk_fsync)
                    ok = True
                    self._record("disk", "write", 1, t0)
                except OSError as e:
                    self._disk_broken = True
                    logger.warning("KVBMConnector: disk tier write failed (%s); no more disk writes", e)
            if not ok:
                self._failed("write")
            self._disk_results.put((key, ok))

    def wait_for_disk(self, timeout: float = 30.0) -> None:
        """Block until queued disk writes are done (shutdown)."""
        if self._writer is not None:
            self._disk_jobs.put(None)
            self._writer.join(timeout)
            self._writer = None

    def shutdown(self) -> None:
        self.wait_for_disk()
