"""A real connector WorkerSide over KV tensors in vLLM's CPU attention layout (one shared buffer,
blocks on dim 0, one attention group), built without a vLLM config: only the fields
register_kv_caches reads. For tests and benchmarks of the worker's copies and disk I/O."""

from __future__ import annotations

import types

import torch

from vllm_kvbm_plugin.connector.layout import KV
from vllm_kvbm_plugin.connector.worker import WorkerSide


def cpu_layout_worker(layers: int, num_blocks: int, block_shape: tuple, slots: int, extra_slot_bytes: int = 0,
                      disk_base: str | None = None) -> tuple[WorkerSide, torch.Tensor]:
    """(worker, the shared KV buffer [layers, num_blocks, *block_shape] in bfloat16, random);
    slots are one entry long plus `extra_slot_bytes`."""
    buf = torch.randn(layers, num_blocks, *block_shape).to(torch.bfloat16)
    kv = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(layers)}
    w = WorkerSide.__new__(WorkerSide)
    w.cfg = types.SimpleNamespace(disk_fsync=False)
    w.kv_cache_config = types.SimpleNamespace(
        num_blocks=num_blocks, kv_cache_groups=[types.SimpleNamespace(layer_names=list(kv))])
    w.groups = {KV: [0]}
    w.slot_bytes = layers * buf[0, 0].numel() * buf.element_size() + extra_slot_bytes
    w.num_slots, w.root, w.rank, w.disk_base = slots, (1, 2), 0, disk_base
    WorkerSide._init_state(w)
    w.register_kv_caches(kv)
    return w, buf
