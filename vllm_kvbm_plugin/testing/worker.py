"""A real connector WorkerSide over KV tensors in vLLM's CPU attention layout (one shared buffer,
blocks on dim 0, one attention group), built from a Layout without an engine. For tests and
benchmarks of the worker's copies and disk I/O."""

from __future__ import annotations

import torch

from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.connector.layout import KV, STATE, Layout
from vllm_kvbm_plugin.connector.worker import WorkerSide


def cpu_layout_worker(layers: int, num_blocks: int, block_shape: tuple, slots: int, extra_slot_bytes: int = 0,
                      disk_path: str | None = None, rank: int = 0, world: int = 1,
                      buf: torch.Tensor | None = None) -> tuple[WorkerSide, torch.Tensor]:
    """(worker, the shared KV buffer [layers, num_blocks, *block_shape] in bfloat16, random unless
    given); slots are one entry long plus `extra_slot_bytes`; block files under `disk_path`."""
    if buf is None:
        buf = torch.randn(layers, num_blocks, *block_shape).to(torch.bfloat16)
    kv = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(layers)}
    slot = layers * buf[0, 0].numel() * buf.element_size() + extra_slot_bytes
    layout = Layout(groups={KV: (0,), STATE: ()}, spec_kinds=("full_attention",), layer_names=(tuple(kv),),
                    num_blocks=num_blocks, block_size=block_shape[1], hash_unit=block_shape[1],
                    slot_bytes=slot, cpu_slots=slots, disk_slots=1 << 20, root=(1, 2), world=world,
                    disk_path=disk_path, secret=bytes(range(16)))
    w = WorkerSide(layout, KVBMConfig(disk_path=disk_path), rank)
    w.register_kv_caches(kv)
    return w, buf
