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


# What a tier entry holds: attention KV of one block, or the recurrent state of a hybrid model at one
# position (vLLM's align-mode Mamba checkpoint). One entry spans every group of its kind.
KV, STATE = "kv", "state"
_ENTRY_OF_KIND = {"full_attention": KV, "mla_attention": KV, "mamba": STATE}


def entry_groups(kv_cache_config) -> dict[str, list[int]]:
    """{KV: [group indices], STATE: [...]} of a KV cache config; other group kinds are refused."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    out: dict[str, list[int]] = {KV: [], STATE: []}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        kind = get_kv_cache_spec_kind(group.kv_cache_spec).value
        if kind not in _ENTRY_OF_KIND:
            raise ValueError(
                f"KVBMConnector: KV cache group {g} is {kind!r}; the tiers hold "
                f"{', '.join(sorted(_ENTRY_OF_KIND))} groups only (run without the connector)")
        out[_ENTRY_OF_KIND[kind]].append(g)
    if not out[KV]:
        raise ValueError("KVBMConnector: the model has no full-attention KV cache group")
    sizes = {group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups}
    if len(sizes) != 1:
        raise ValueError(f"KVBMConnector: KV cache groups with different block sizes {sorted(sizes)} "
                         "are not supported")
    return out


def slot_bytes(kv_cache_config) -> int:
    """Bytes of one pool slot: the larger of a KV entry and a state entry (vLLM's padded pages)."""
    groups = kv_cache_config.kv_cache_groups
    return max(sum(groups[g].kv_cache_spec.page_size_bytes * len(groups[g].layer_names) for g in gs)
               for gs in entry_groups(kv_cache_config).values())


# Keys of the entries a hybrid hit at X needs besides whole blocks: the state at X and the KV block
# that X ends inside. Derived from the unit key of X by a fixed tag, so they never equal a block key.
_STATE_TAG, _PARTIAL_TAG = 0x5354415445000001, 0x5041525449000002


def state_key(unit_key: tuple[int, int]) -> tuple[int, int]:
    return (unit_key[0] ^ _STATE_TAG, unit_key[1])


def partial_key(unit_key: tuple[int, int]) -> tuple[int, int]:
    return (unit_key[0] ^ _PARTIAL_TAG, unit_key[1])
