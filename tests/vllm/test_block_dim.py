"""The worker finds a KV cache tensor's blocks the way vLLM lays them out (compat.block_major_view),
never by looking for a dimension as long as the block count: the tensors come from vLLM's own
allocator (allocate_kv_cache) in every KVCacheLayout, with block counts equal to other
dimensions (2 = K and V, 4 = the KV heads) and with blocks split into kernel blocks (a hybrid
model's inflated block on a backend with smaller pages), where the block count appears at
another dimension only. A block stored to a slot and loaded into another block must arrive
whole, and no other block may change."""

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.layout import KV, STATE, Layout
from vllm_kvbm_plugin.connector.worker import WorkerSide

NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def _kv_caches(num_blocks: int, block_size: int, heads: int, layout: KVCacheLayout, kernel: int | None = None):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=8, dtype=torch.bfloat16)
    strides = compute_layout_strides(spec, num_blocks, len(NAMES), layout)
    tensor = KVCacheTensor(size=len(NAMES) * num_blocks * spec.page_size_bytes, layers=NAMES,
                           layer_stride=strides[0], block_stride=strides[1])
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                           kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    kv = allocate_kv_cache(config, torch.device("cpu"), layout, [kernel] if kernel else None)
    raw = torch.empty(0, dtype=torch.uint8).set_(kv[NAMES[0]].untyped_storage())
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    return kv, spec


def _worker(kv: dict, num_blocks: int, block_size: int, page: int) -> WorkerSide:
    layout = Layout(groups={KV: (0,), STATE: ()}, spec_kinds=("full_attention",), layer_names=(tuple(NAMES),),
                    num_blocks=num_blocks, block_size=block_size, hash_unit=block_size,
                    slot_bytes=4 * len(NAMES) * page, cpu_slots=2, disk_slots=1, root=(1, 2), world=1,
                    disk_path=None, secret=bytes(16))  # slots room for block-outermost pages (a layer's view spans them all)
    w = WorkerSide(layout, KVBMConfig(), 0)
    w.register_kv_caches(kv)
    return w


def _round_trip(kv: dict, num_blocks: int, block_size: int, page: int, src: int, dst: int) -> None:
    # vLLM's blocks (kernel blocks grouped), compared as bytes (random bytes hold NaNs)
    blocks = {n: t.view(torch.uint8).unflatten(0, (num_blocks, -1)) for n, t in kv.items()}
    before = {n: b.clone() for n, b in blocks.items()}
    w = _worker(kv, num_blocks, block_size, page)
    w._copy([(KV, (src,), 1)], to_pool=True)
    w._copy([(KV, (dst,), 1)], to_pool=False)
    for n, b in blocks.items():
        assert torch.equal(b[dst], before[n][src]), n
        others = [i for i in range(num_blocks) if i != dst]
        assert torch.equal(b[others], before[n][others]), n


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("num_blocks", [2, 4], ids=["blocks=2=K|V", "blocks=4=heads"])
def test_blocks_are_found_in_every_vllm_layout(layout, num_blocks):
    kv, spec = _kv_caches(num_blocks, 16, 4, layout)
    assert kv[NAMES[0]].shape[1] == 4 and kv[NAMES[0]].shape[0] == num_blocks
    _round_trip(kv, num_blocks, 16, spec.page_size_bytes, src=num_blocks - 1, dst=0)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC], ids=lambda x: x.name)
def test_kernel_blocks_are_grouped_under_their_block(layout):
    """64-token blocks on a backend with 16-token kernel blocks: vLLM's view has 4 x 4 kernel
    blocks on dim 0 and 4 KV heads on dim 1, the only dimension as long as the block count."""
    kv, spec = _kv_caches(4, 64, 4, layout, kernel=16)
    assert tuple(kv[NAMES[0]].shape[:2]) == (16, 4)
    _round_trip(kv, 4, 64, spec.page_size_bytes, src=2, dst=1)


def test_a_tensor_without_blocks_on_dim_0_is_refused_by_name():
    kv, spec = _kv_caches(4, 16, 4, KVCacheLayout.LBHNC)
    kv[NAMES[1]] = torch.zeros(4 * spec.page_size_bytes + 1, dtype=torch.int8)  # a raw backing buffer
    with pytest.raises(ValueError, match="layers.1.self_attn"):
        _worker(kv, 4, 16, spec.page_size_bytes)
