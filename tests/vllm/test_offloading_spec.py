"""KVBMOffloadingSpec in-process (0.32 and 0.33, CPU platform): our defaults, and KVBMCPUWorker's
copies land where vLLM's primary tier (and so every secondary tier) reads them."""

import uuid

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from vllm_kvbm_plugin.offloading import KVBMCPUWorker, KVBMDiskTier, KVBMOffloadingSpec, LineageCachePolicy
from vllm_kvbm_plugin.testing.offloading_drive import offloading_config, primary_rows

PAGE = 4096


def test_spec_defaults_and_cpu_worker_round_trip(tmp_path):
    extra = {"spec_name": "KVBMOffloadingSpec", "spec_module_path": "vllm_kvbm_plugin.offloading",
             "cpu_bytes_to_use": 2 * 8 * PAGE, "disk_path": str(tmp_path), "disk_bytes_to_use": 1 << 20}
    spec = KVBMOffloadingSpec(offloading_config(extra, 2 * PAGE, engine_id=f"kvbm-spec-{uuid.uuid4().hex[:8]}"))
    m = spec.get_manager()
    worker = None
    try:
        assert isinstance(m.primary_tier._policy, LineageCachePolicy)
        (tier,) = m.secondary_tiers
        assert isinstance(tier, KVBMDiskTier) and tier.root == str(tmp_path)
        # two KV tensors (e.g. two layers) of one group, PAGE bytes per block each
        layers = [torch.randint(-128, 127, (16, PAGE), dtype=torch.int8) for _ in range(2)]
        kv = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(t, PAGE) for t in layers],
                               group_data_refs=[[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]])
        worker = spec.get_worker(kv)
        assert isinstance(worker, KVBMCPUWorker)
        worker.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), CPULoadStoreSpec([6, 2]))
        rows = primary_rows(m)  # the scheduler side's view: what secondary tiers write to disk
        for block, chunk in ((3, 6), (5, 2)):
            assert np.array_equal(rows[chunk, :PAGE], layers[0][block].numpy().view(np.uint8))
            assert np.array_equal(rows[chunk, PAGE: 2 * PAGE], layers[1][block].numpy().view(np.uint8))
        worker.submit_load(2, CPULoadStoreSpec([2, 6]), GPULoadStoreSpec([9, 10], [2], [0]))
        assert torch.equal(layers[0][9], layers[0][5]) and torch.equal(layers[1][10], layers[1][3])
        done = {r.job_id: r for r in worker.get_finished()}
        assert done[1].success and done[2].success and done[1].transfer_size == 2 * 2 * PAGE
        del rows
    finally:
        if worker is not None:
            worker.shutdown()
        m.shutdown()


def test_cpu_worker_copies_chunks_of_several_blocks(tmp_path):
    """Chunks of 2 KV blocks (block_size twice the KV cache's): a chunk row holds each tensor's
    2 pages one after another; a request's first chunk may be entered at its second page."""
    extra = {"spec_name": "KVBMOffloadingSpec", "spec_module_path": "vllm_kvbm_plugin.offloading",
             "cpu_bytes_to_use": 8 * 2 * 2 * PAGE}
    spec = KVBMOffloadingSpec(offloading_config(extra, 2 * PAGE, engine_id=f"kvbm-spec-{uuid.uuid4().hex[:8]}",
                                                blocks_per_chunk=2))
    m = spec.get_manager()
    worker = None
    try:
        layers = [torch.randint(-128, 127, (16, PAGE), dtype=torch.int8) for _ in range(2)]
        kv = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(t, PAGE) for t in layers],
                               group_data_refs=[[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]])
        worker = spec.get_worker(kv)
        assert isinstance(worker, KVBMCPUWorker) and worker.per_chunk == 2
        rows = primary_rows(m)
        assert rows.shape[1] >= 4 * PAGE
        untouched = rows[6, :PAGE].copy()
        # blocks 3, 5, 7 from the request's block 1 on: chunk 6 from its page 1, then chunk 2
        worker.submit_store(1, GPULoadStoreSpec([3, 5, 7], [3], [1]), CPULoadStoreSpec([6, 2]))

        def page(chunk, layer, j):  # tensor `layer`'s page j of the chunk
            a = (2 * layer + j) * PAGE
            return rows[chunk, a: a + PAGE]
        for chunk, j, block in ((6, 1, 3), (2, 0, 5), (2, 1, 7)):
            for layer in (0, 1):
                assert np.array_equal(page(chunk, layer, j), layers[layer][block].numpy().view(np.uint8))
        assert np.array_equal(rows[6, :PAGE], untouched)  # the page before the request's first block
        worker.submit_load(2, CPULoadStoreSpec([2]), GPULoadStoreSpec([9, 10], [2], [0]))
        worker.submit_load(3, CPULoadStoreSpec([6]), GPULoadStoreSpec([11], [1], [1]))
        for layer in (0, 1):
            assert torch.equal(layers[layer][9], layers[layer][5]) and torch.equal(layers[layer][10], layers[layer][7])
            assert torch.equal(layers[layer][11], layers[layer][3])
        before = [t.clone() for t in layers]
        worker.submit_load(4, CPULoadStoreSpec([2]), GPULoadStoreSpec([12, 13, 14], [3], [0]))  # 3 blocks, 1 chunk
        assert all(torch.equal(a, b) for a, b in zip(before, layers))  # refused, nothing copied
        done = {r.job_id: r for r in worker.get_finished()}
        assert done[1].success and done[1].transfer_size == 3 * 2 * PAGE
        assert done[2].success and done[3].success and not done[4].success
        del rows
    finally:
        if worker is not None:
            worker.shutdown()
        m.shutdown()
