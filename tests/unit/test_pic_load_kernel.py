"""The worker's load kernel (connector/pic_load._load_layer) writes exactly what the torch path
writes: K re-rotated with the same float32 arithmetic and one rounding, V copied bit for bit,
nothing else in the cache touched (float32 and bf16, neox and GPT-J pairs, partial rotary)."""

import types

import pytest
import torch

from vllm_kvbm_plugin.connector import pic_load
from vllm_kvbm_plugin.connector.metadata import PicLoad
from vllm_kvbm_plugin.connector.pic_model import PicModel
from vllm_kvbm_plugin.reuse.rope import RopeSpec

B, D, HEADS, BLOCKS, SLOTS, LAYERS = 32, 64, 2, 12, 6, 2


def run(dtype, rope, kernel: bool | None, monkeypatch):
    g = torch.Generator().manual_seed(3)
    layer_bytes = HEADS * B * 2 * D * torch.finfo(dtype).bits // 8
    elements = LAYERS * layer_bytes * 8 // torch.finfo(dtype).bits
    pool = torch.randn(SLOTS, elements, generator=g).to(dtype).view(torch.uint8)
    caches = [torch.randn(BLOCKS, HEADS, B, 2 * D, generator=g).to(dtype) for _ in range(LAYERS)]
    layers = [types.SimpleNamespace(tensor=c, dim=0, offset=i * layer_bytes) for i, c in enumerate(caches)]
    ops = [PicLoad((3,), 5, 2, 0, 27, 64, 101), PicLoad((4,), 0, 2, 27, 5, 91, 128),
           PicLoad((7,), 10, 4, 3, 22, 419, 10), PicLoad((3,), 0, 0, 31, 1, 31, 96)]
    if kernel is None:  # the caches before any load
        return caches
    monkeypatch.setattr(pic_load, "_RAW", pic_load._RAW if kernel else {})
    pic_load.load(ops, PicModel(rope, 1024), B, [layers], pool, 0, lambda ids: pytest.fail("failed"),
                  lambda counts: None)
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [RopeSpec(D, D), RopeSpec(D, D, is_neox_style=False), RopeSpec(D, D // 2)],
                         ids=["neox", "gptj", "partial"])
def test_kernel_writes_what_the_torch_path_writes(dtype, rope, monkeypatch):
    torch_path = run(dtype, rope, kernel=False, monkeypatch=monkeypatch)
    kernel = run(dtype, rope, kernel=True, monkeypatch=monkeypatch)
    for a, b in zip(torch_path, kernel):
        assert torch.equal(a, b)
    for a, b in zip(run(dtype, rope, kernel=None, monkeypatch=monkeypatch), kernel):
        assert not torch.equal(a[3:5], b[3:5]) and torch.equal(a[:3], b[:3])  # loaded blocks only
