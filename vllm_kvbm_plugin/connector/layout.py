"""The layout both connector sides share, built once from vLLM's configs: which KV cache groups a
tier entry spans, block and hash-unit sizes, slot size and counts, the key root, the tier
directories. The scheduler side plans with it, the workers copy and name files with it, and tests
build either side from it without an engine.

The key root salts every block key with what makes KV bytes differ (model, dtype, KV cache spec,
hash unit, tensor-parallel size), so two models or layouts sharing a `disk_path` never collide;
the workers add their rank to the directory and check the exact tensor layout in each file header.
Keys and root are keyed by the tier secret (tiers/secret.py), so the tier directory and the remote
key prefix change with the secret and the key spec version; the directory spec 1 wrote for the same
layout is removed when the scheduler side starts, if it holds nothing but block files
(remove_v1_tier_dir).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
from typing import TYPE_CHECKING, NamedTuple

from vllm_kvbm_plugin.hashing import Keyer
from vllm_kvbm_plugin.hashing.spec import v1_root_key
from vllm_kvbm_plugin.log import get_logger
from vllm_kvbm_plugin.tiers import block_dir, block_file

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_kvbm_plugin.config import KVBMConfig

logger = get_logger("layout")


class EntryKind(enum.Enum):
    """What a tier entry holds: the attention KV of one block, or the recurrent state of a hybrid
    model at one position (vLLM's align-mode Mamba checkpoint). One entry spans every group of its
    kind."""
    KV = "kv"
    STATE = "state"


KV, STATE = EntryKind.KV, EntryKind.STATE
_ENTRY_OF_KIND = {"full_attention": KV, "mla_attention": KV, "mamba": STATE}


@dataclasses.dataclass(frozen=True)
class Layout:
    """What both halves of KVBMConnector agree on about vLLM's KV cache and the tiers: which groups
    hold KV and which recurrent state, block and hash-unit sizes, slot size and counts, the key root
    and (scheduler side) the Keyer. Built once per process from vLLM's config (`from_vllm`)."""

    groups: dict[EntryKind, tuple[int, ...]]  # KV cache group indices per kind
    spec_kinds: tuple[str, ...]  # vLLM's kv_cache_spec_kind per group (for events)
    layer_names: tuple[tuple[str, ...], ...]  # per group
    num_blocks: int  # vLLM's KV cache blocks (finds the block dimension of a KV tensor)
    block_size: int  # vLLM's (possibly inflated) block
    hash_unit: int  # hash_block_size: hybrid hits land on these boundaries
    slot_bytes: int  # one tier entry, the larger of a KV and a state entry
    cpu_slots: int
    disk_slots: int
    root: tuple[int, int] | None  # the key root (see module docstring); a worker's: None until it follows the decision
    world: int  # workers that each hold a shard and report every operation
    disk_path: str | None
    keyer: Keyer | None = dataclasses.field(default=None, repr=False, compare=False)  # the scheduler's
    secret: bytes = dataclasses.field(default=b"", repr=False, compare=False)  # the tier secret (tiers/secret.py)
    remote_off: bool = False  # remote_url is set but the tier secret could not be read from it
    secret_source: str = ""  # tiers/secret.TierSecret.source
    v1_root: tuple[int, int] | None = None  # the scheduler's: the root key spec 1 derived (remove_v1_tier_dir)

    @property
    def hybrid(self) -> bool:
        return bool(self.groups[STATE])

    @property
    def disk_meta_bytes(self) -> int:
        return disk_meta_bytes(self.slot_bytes, self.block_size, self.groups)

    @property
    def units_per_block(self) -> int:
        return self.block_size // self.hash_unit

    @property
    def tier_dir(self) -> str | None:
        return tier_dir(self.disk_path, self.decided_root()) if self.disk_path else None

    def rank_dir(self, rank: int) -> str | None:
        return rank_dir(self.disk_path, self.decided_root(), rank) if self.disk_path else None

    def decided_root(self) -> tuple[int, int]:
        """The key root; a worker's is known once it follows the scheduler side's decision."""
        if self.root is None:
            raise RuntimeError("KVBMConnector: the key root is used before the scheduler side decided it")
        return self.root

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: KVBMConfig,
                  decide: bool = True) -> "Layout":
        """The layout of this engine. `decide` (the scheduler side): also read the tier secret and
        derive the key root from it. A worker passes False: it follows the scheduler side's
        decision (`decision()`, sent with the first step), never reads the secret itself."""
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

        kv_groups = kv_cache_config.kv_cache_groups
        groups = entry_groups(kv_cache_config)
        block_size = kv_groups[0].kv_cache_spec.block_size
        unit = kv_cache_config.hash_block_size or block_size  # the patch applied cfg.hash_block_size
        size = slot_bytes(kv_cache_config, groups)
        secret = keyer = root = None
        if decide:
            from vllm_kvbm_plugin.tiers.secret import tier_secret

            secret = tier_secret(cfg.remote_url, cfg.disk_path)
            keyer = Keyer(secret.key)
            root = key_root(vllm_config, kv_cache_config, unit, keyer)
        return cls(
            groups=groups,
            spec_kinds=tuple(get_kv_cache_spec_kind(g.kv_cache_spec).value for g in kv_groups),
            layer_names=tuple(tuple(g.layer_names) for g in kv_groups),
            num_blocks=kv_cache_config.num_blocks,
            block_size=block_size,
            hash_unit=unit,
            slot_bytes=size,
            cpu_slots=cfg.cpu_bytes_to_use // size,
            disk_slots=cfg.disk_bytes_to_use // block_file.file_footprint(size, disk_meta_bytes(size, block_size, groups)),
            root=root,
            world=vllm_config.parallel_config.world_size,
            disk_path=cfg.disk_path,
            keyer=keyer,
            secret=secret.key if secret else b"",
            remote_off=secret.remote_off if secret else False,
            secret_source=secret.source if secret else "",
            v1_root=v1_key_root(vllm_config, kv_cache_config, unit) if decide else None,
        )

    def decision(self) -> TierDecision:
        """What the workers must follow (scheduler side)."""
        return TierDecision(self.secret, self.decided_root(), not self.remote_off, self.secret_source)

    def following(self, decision: TierDecision) -> "Layout":
        """A worker's layout once it follows `decision`."""
        return dataclasses.replace(self, root=decision.root, secret=decision.secret, remote_off=not decision.remote,
                                   secret_source=decision.source)


class TierDecision(NamedTuple):
    """What the scheduler side decides once for the whole engine and hands to every worker with the
    first step's metadata: the tier secret and the key root derived from it (tier directory,
    remote key prefix, block MACs) and whether the remote tier is on. With tensor parallelism each
    worker process deciding alone could end with two secrets, or a worker without the remote tier
    the scheduler plans fetches for (Redis down for one process's start)."""

    secret: bytes
    root: tuple[int, int]
    remote: bool  # False: remote_url is set but the secret could not be read; the tier is off everywhere
    source: str  # where the secret came from (tiers/secret.py), for the log

    def __repr__(self) -> str:  # never the secret
        return f"TierDecision(root={self.root[0]:016x}{self.root[1]:016x}, remote={self.remote}, source={self.source})"


def disk_meta_bytes(slot_bytes: int, block_size: int, groups: dict[EntryKind, tuple[int, ...]]) -> int:
    """Room for a block file's metadata: its events (one per group, each with the entry's token
    ids, at most 5 bytes each, and extra keys) plus what rounding the file to whole FS_BLOCKs adds.
    An entry whose metadata needs more is not written to disk (DiskTier.prepare_write)."""
    need = 64 + max(len(g) for g in groups.values()) * (512 + 5 * block_size)
    return block_file.file_footprint(slot_bytes, need) - block_file.HEADER_SIZE - slot_bytes


def _root_fields(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, unit: int) -> tuple[str, str, str, int, int, int]:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    specs = "|".join(repr(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups)
    return str(mc.model), str(mc.dtype), specs, unit, 0, pc.tensor_parallel_size * pc.pipeline_parallel_size


def key_root(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, unit: int, keyer: Keyer) -> tuple[int, int]:
    return keyer.root(*_root_fields(vllm_config, kv_cache_config, unit))


def v1_key_root(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, unit: int) -> tuple[int, int]:
    """The root spec 1 computed for this layout: the name of the tier directory it wrote."""
    return v1_root_key(*_root_fields(vllm_config, kv_cache_config, unit))


def tier_dir(disk_path: str, root: tuple[int, int]) -> str:
    return os.path.join(disk_path, f"{root[0]:016x}{root[1]:016x}")


def rank_dir(disk_path: str, root: tuple[int, int], rank: int) -> str:
    return os.path.join(tier_dir(disk_path, root), f"r{rank}")


def remove_v1_tier_dir(disk_path: str, v1_root: tuple[int, int]) -> int:
    """Remove `<disk_path>/<v1 root hex>`, the tier directory spec 1 wrote for this layout (its
    entries are misses under spec 2), if it holds nothing but ours (tiers/block_dir.py remove_tier_dir);
    else leave it whole (logged). Returns the block files removed."""
    name = f"{v1_root[0]:016x}{v1_root[1]:016x}"
    removed, foreign = block_dir.remove_tier_dir(disk_path, name)
    if foreign:
        logger.warning("KVBM disk tier: %s (written by key spec 1, all misses now) is left as it is: it holds %s",
                       os.path.join(disk_path, name), foreign)
    elif removed:
        logger.info("KVBM disk tier: removed %s, the tier directory key spec 1 wrote for this layout (%d block "
                    "files, all misses under spec 2)", os.path.join(disk_path, name), removed)
    return removed


def tensor_fingerprint(root: tuple[int, int], layers: list[tuple[str, tuple, str, int]]) -> bytes:
    """16 bytes naming the exact per-block byte layout a worker reads and writes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{root[0]:016x}{root[1]:016x}".encode())
    for name, shape, dtype, dim in layers:
        h.update(f"{name}:{shape}:{dtype}:{dim};".encode())
    return h.digest()


def entry_groups(kv_cache_config: KVCacheConfig) -> dict[EntryKind, tuple[int, ...]]:
    """{KV: (group indices), STATE: (...)} of a KV cache config; other group kinds are refused."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    out: dict[EntryKind, list[int]] = {KV: [], STATE: []}
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
    return {kind: tuple(gs) for kind, gs in out.items()}


def slot_bytes(kv_cache_config: KVCacheConfig, groups: dict[EntryKind, tuple[int, ...]]) -> int:
    """Bytes of one pool slot: the larger of a KV entry and a state entry (vLLM's padded pages)."""
    kv_groups = kv_cache_config.kv_cache_groups
    return max(sum(kv_groups[g].kv_cache_spec.page_size_bytes * len(kv_groups[g].layer_names) for g in gs)
               for gs in groups.values())


# Keys of the entries a hybrid hit at X needs besides whole blocks: the state at X and the KV block
# that X ends inside. Derived from the unit key of X by a fixed tag, so they never equal a block key.
_STATE_TAG, _PARTIAL_TAG = 0x5354415445000001, 0x5041525449000002


def state_key(unit_key: tuple[int, int]) -> tuple[int, int]:
    return (unit_key[0] ^ _STATE_TAG, unit_key[1])


def partial_key(unit_key: tuple[int, int]) -> tuple[int, int]:
    return (unit_key[0] ^ _PARTIAL_TAG, unit_key[1])
