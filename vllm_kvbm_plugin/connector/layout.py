"""Identity of a KV layout: the root of the block keys and the disk tier's directory.

The key root salts every block key with what makes KV bytes differ (model, dtype, KV cache spec,
hash unit, tensor-parallel size), so two models or layouts sharing a `disk_path` never collide;
the workers add their rank to the directory and check the exact tensor layout in each file header.
"""

from __future__ import annotations

import hashlib
import os

from vllm_kvbm_plugin.hashing import root_key


def key_root(vllm_config, kv_cache_config, unit: int) -> tuple[int, int]:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    specs = "|".join(repr(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups)
    return root_key(str(mc.model), str(mc.dtype), specs, unit, 0, pc.tensor_parallel_size * pc.pipeline_parallel_size)


def tier_dir(disk_path: str, root: tuple[int, int]) -> str:
    return os.path.join(disk_path, f"{root[0]:016x}{root[1]:016x}")


def rank_dir(disk_path: str, root: tuple[int, int], rank: int) -> str:
    return os.path.join(tier_dir(disk_path, root), f"r{rank}")


def tensor_fingerprint(root: tuple[int, int], layers: list[tuple[str, tuple, str, int]]) -> bytes:
    """16 bytes naming the exact per-block byte layout a worker reads and writes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{root[0]:016x}{root[1]:016x}".encode())
    for name, shape, dtype, dim in layers:
        h.update(f"{name}:{shape}:{dtype}:{dim};".encode())
    return h.digest()
