"""K and V inside vLLM's CPU attention KV cache ("vec" kernels), as views (pure torch).

Both sides of position-independent reuse read this layout: the worker's loads
(connector/pic_load.py) write re-rotated K and copied V into it, and the selective-recompute
attention patch (patches/pic_blend.py) reads the loaded K and V back from it.
"""

from __future__ import annotations

import torch


def kv_views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of vLLM's CPU attention ("vec" kernels) in a layer's KV tensor [blocks, heads,
    block, 2 * head] (the shape hides the layout): per block and head, K as [head, block] (token b
    is column b), then V as [block, head]. Returns views k [blocks, heads, head, block] and
    v [blocks, heads, block, head]. Checked against a real engine's layer-0 KV (test_pic_engine)."""
    n, heads, block, two_d = t.shape
    flat = t.view(n, heads, 2, block * two_d // 2)
    return flat[:, :, 0].view(n, heads, two_d // 2, block), flat[:, :, 1].view(n, heads, block, two_d // 2)
