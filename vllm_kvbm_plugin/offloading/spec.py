"""KVBMOffloadingSpec: vLLM's tiering spec (a CPU primary tier plus secondary tiers) with our
defaults, and a worker of ours where vLLM has none (the CPU platform).

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {"spec_name": "KVBMOffloadingSpec",
                                  "spec_module_path": "vllm_kvbm_plugin.offloading",
                                  "cpu_bytes_to_use": N, "disk_path": DIR, "disk_bytes_to_use": M}

Defaults: eviction_policy LineageCachePolicy (ours); self_describing_kv_events true; with `disk_path`, one KVBMDiskTier secondary
tier there (`disk_bytes_to_use`, default 10 GiB; `disk_eviction_policy`, default lineage) unless
`secondary_tiers` is given. Everything else is TieringOffloadingSpec's.

Worker: on CUDA/ROCm/XPU vLLM's own (CUDA streams, pinned shared memory, tested by vLLM). On the
CPU platform, where vLLM refuses, KVBMCPUWorker: our numba page copies (tiers/copy.py) between
vLLM's CPU KV tensors and the same shared-memory primary tier vLLM's worker would use, done
synchronously at submit (a CPU forward uses every core anyway). Chunks of one or several KV blocks
(`block_size` a multiple of the KV cache block size; a request's first chunk of a group may be
entered part way, as vLLM's worker does), the direct (non-canonical) layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers.copy import copy_pages

logger = get_logger("offloading")

MODULE = "vllm_kvbm_plugin.offloading"
DEFAULT_DISK_BYTES = 10 << 30


def with_defaults(extra: Mapping[str, Any]) -> dict[str, Any]:
    """kv_connector_extra_config with our defaults filled in."""
    extra = dict(extra)
    # tier events with hashes, parents, tokens and (patches/offload_events.py) image keys, as a
    # router needs them; vLLM's default is a bare hash per chunk
    extra.setdefault("self_describing_kv_events", True)
    if "eviction_policy" not in extra:
        extra["eviction_policy"] = "LineageCachePolicy"
        extra["cache_policy_module_path"] = MODULE
    if "secondary_tiers" not in extra and extra.get("disk_path"):
        extra["secondary_tiers"] = [{
            "type": "KVBMDiskTier", "module_path": MODULE, "path": extra["disk_path"],
            "bytes_to_use": int(extra.get("disk_bytes_to_use", DEFAULT_DISK_BYTES)),
            "eviction_policy": extra.get("disk_eviction_policy", "lineage"),
        }]
    return extra


def vllm_has_a_worker() -> bool:
    """Where vLLM's own CPUOffloadingWorker runs (CPUOffloadingSpec.get_worker's check)."""
    return current_platform.is_cuda_alike() or current_platform.is_xpu()


class KVBMOffloadingSpec(TieringOffloadingSpec):
    """The spec vLLM's OffloadingConnector loads through `spec_module_path`: vLLM's tiering spec with
    our defaults (policies, KVBMDiskTier/KVBMRemoteTier as secondary tiers) and, on the CPU platform
    where vLLM has no worker, our KVBMCPUWorker. Built in the scheduler and in each worker."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(dataclasses.replace(config, extra_config=with_defaults(config.extra_config)))

    def get_manager(self) -> OffloadingManager:
        manager = super().get_manager()
        if not vllm_has_a_worker():  # our worker knows the name may be gone (KVBMCPUWorker.shutdown)
            release_region_name(getattr(self, "_scheduler_mmap", None))
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if vllm_has_a_worker():
            return super().get_worker(kv_caches)
        if self._worker is None:
            # vLLM's slot for its CPU worker holds ours on the CPU platform (where it has none)
            self._worker = cpu_platform_worker(self, kv_caches)  # type: ignore[assignment]
        assert self._worker is not None
        return self._worker


def release_region_name(region: SharedOffloadRegion | None) -> None:
    """Unlink the primary tier's /dev/shm file once the scheduler side has mapped it: every worker
    mapped it before (the engine registers the workers' KV caches before it builds the scheduler),
    so the name is no longer needed and the memory goes back when the engine's processes exit,
    however they exit. vLLM's tiering spec unlinks it only when its creator cleans up, which our
    CPU-platform worker's process never did (each engine run left `cpu_bytes_to_use` of /dev/shm
    behind); with vLLM's own worker (GPUs) a killed engine leaks it the same way, but that worker
    would log a traceback failing to unlink a name already gone, so it is left to vLLM there.
    Where the scheduler side created the file (no worker has opened it yet) it is left alone."""
    if region is None or getattr(region, "_creator", True):
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(region.mmap_path)
        logger.info("KVBMOffloadingSpec: unlinked %s (mapped by every process that uses it)", region.mmap_path)


def cpu_platform_worker(spec: TieringOffloadingSpec, kv_caches: CanonicalKVCaches) -> KVBMCPUWorker:
    """A KVBMCPUWorker over the shared-memory primary tier of `spec` (vLLM's CPUOffloadingSpec or a
    subclass), where vLLM's own CPUOffloadingWorker would put its pages."""
    if spec.config.canonical_layout:
        raise ValueError("KVBMOffloadingSpec on the CPU platform: canonical_layout is not supported")
    rank = 0 if spec.replicated_layout else spec.config.parallel.rank
    region = SharedOffloadRegion(engine_id=spec.config.engine_id, num_chunks=spec.num_chunks, rank=rank,
                                 kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
                                 cpu_page_size=spec.cpu_page_size_per_worker)
    try:
        worker = KVBMCPUWorker(kv_caches, region, spec.blocks_per_chunk)
    except Exception:
        region.cleanup()
        raise
    logger.info("KVBMOffloadingSpec: CPU-platform worker, %d chunks of %d bytes", spec.num_chunks,
                spec.kv_bytes_per_chunk)
    return worker


def _words(t: torch.Tensor, what: str) -> np.ndarray:
    if not t.is_contiguous():
        raise ValueError(f"KVBMCPUWorker: {what} is not contiguous")
    a = t.detach().view(torch.uint8).reshape(-1).numpy()
    if a.nbytes % 8 or a.ctypes.data % 8:
        raise ValueError(f"KVBMCPUWorker: {what} is not made of aligned 8-byte words")
    return a.view(np.uint64)


class KVBMCPUWorker(OffloadingWorker):
    """Copies between vLLM's CPU KV tensors (one page per block) and the primary tier's shared
    memory (a chunk row holds every worker's pages; this worker's part of tensor t at the offset
    SharedOffloadRegion gives it, the chunk's `blocks_per_chunk` pages of t one after another)."""

    def __init__(self, kv_caches: CanonicalKVCaches, region: SharedOffloadRegion, blocks_per_chunk: int = 1) -> None:
        self.region: SharedOffloadRegion | None = region
        self.per_chunk = int(blocks_per_chunk)
        self.pool_words = _words(region.base_tensor, "the shared offload region")
        self.pages: list[np.ndarray] = []
        self.page_words: list[int] = []
        self.offsets: list[int] = []
        row_stride = None
        for i, t in enumerate(kv_caches.tensors):
            page = t.page_size_bytes
            view = region.create_next_worker_view(page * self.per_chunk)  # where vLLM's own worker puts it
            row_stride = view.stride(0)
            if page % 8 or view.storage_offset() % 8 or row_stride % 8:
                raise ValueError(f"KVBMCPUWorker: KV tensor {i}: pages of {page} bytes are not 8-byte words")
            self.pages.append(_words(t.tensor, f"KV tensor {i}"))
            self.page_words.append(page // 8)
            self.offsets.append(view.storage_offset() // 8)
        self.row_words = (row_stride or 8) // 8
        self.refs = [[r.tensor_idx for r in refs] for refs in kv_caches.group_data_refs]
        self.finished: list[TransferResult] = []

    def _pages_of(self, gpu_spec: GPULoadStoreSpec,
                  chunks: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """Per group: (KV block ids, their chunks, their page index within the chunk), or None when
        the spec's counts do not add up. A group's blocks fill its chunks in order, the first
        chunk from page block_index % blocks_per_chunk on (vLLM's rule)."""
        k, start, used = self.per_chunk, 0, 0
        out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        gpu_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        sizes, firsts = list(gpu_spec.group_sizes), gpu_spec.block_indices
        firsts = [0] * len(sizes) if firsts is None else list(firsts)
        if len(sizes) != len(self.refs) or sum(sizes) != len(gpu_ids):
            return None
        for size, first in zip(sizes, firsts):
            skip = int(first) % k
            n = -(-(size + skip) // k) if size else 0
            if used + n > len(chunks):
                return None
            page = (chunks[used: used + n, None] * k + np.arange(k, dtype=np.int64)).reshape(-1)[skip: skip + size]
            out.append((gpu_ids[start: start + size], page // k, page % k))
            start, used = start + size, used + n
        return out if used == len(chunks) else None

    def _copy(self, job_id: int, gpu_spec: GPULoadStoreSpec, cpu_spec: LoadStoreSpec, to_pool: bool) -> bool:
        t0 = time.perf_counter()
        assert isinstance(cpu_spec, BlockIDsLoadStoreSpec)  # the primary tier's chunks
        chunks = np.asarray(cpu_spec.block_ids, dtype=np.int64)
        groups = self._pages_of(gpu_spec, chunks)
        if groups is None:
            logger.error("KVBMCPUWorker: job %d names %d KV blocks in groups %s for %d chunks of %d blocks: "
                         "the counts do not add up", job_id, len(gpu_spec.block_ids), list(gpu_spec.group_sizes),
                         len(chunks), self.per_chunk)
            self.finished.append(TransferResult(job_id, False))
            return True
        jobs, nbytes = [], 0
        for (ids, slots, page), tensors in zip(groups, self.refs):
            for j in range(self.per_chunk):
                on = page == j
                if not on.any():
                    continue
                for t in dict.fromkeys(tensors):  # page j of tensor t: j pages past t's offset in the row
                    w = self.page_words[t]
                    jobs.append((self.pages[t], w, self.offsets[t] + j * w, ids[on], slots[on]))
                    nbytes += 8 * w * int(on.sum())
        try:
            copy_pages(jobs, self.pool_words, self.row_words, to_pool)
            ok = True
        except Exception:
            logger.exception("KVBMCPUWorker: copy of job %d failed", job_id)
            ok = False
        self.finished.append(TransferResult(job_id, ok, nbytes if ok else None, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_pool=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_pool=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when submit returns

    def shutdown(self) -> None:
        self.pages, self.pool_words = [], np.empty(0, np.uint64)  # no view of the region may remain
        if self.region is not None:
            if not os.path.exists(self.region.mmap_path):  # released (release_region_name): nothing to unlink
                self.region._creator = False
            self.region.cleanup()
            self.region = None
