"""The sub-sequence index fed from our KV event stream (BlockStored carries token ids), and
`vllm-kvbm match` over a recorded stream."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import IO, TYPE_CHECKING

from vllm_kvbm_plugin.reuse.subseq_index import SubseqIndex

if TYPE_CHECKING:
    from vllm_kvbm_plugin.events.types import KVEventBatch

# event groups whose blocks are not plain per-token KV (state checkpoints) or not all kept
_SKIP_KINDS = frozenset({"mamba", "sliding_window", "sliding_window_mla", "chunked_local_attention"})


def event_unit(batches: Iterable[KVEventBatch]) -> int | None:
    """The hash unit of a recorded stream: the smallest block size of a BlockStored with tokens
    (hybrid models also announce coarse blocks; per-unit events are the smaller ones)."""
    from vllm_kvbm_plugin.events.types import BlockStored

    unit = None
    for batch in batches:
        for ev in batch.events:
            if (isinstance(ev, BlockStored) and ev.token_ids and ev.block_hashes
                    and ev.kv_cache_spec_kind not in _SKIP_KINDS):
                unit = ev.block_size if unit is None else min(unit, ev.block_size)
    return unit


def feed_batch(index: SubseqIndex, batch: KVEventBatch, worker: Hashable = None, lora_name: str | None = None) -> None:
    """Apply one KVEventBatch: units are keyed by block hash, held per (worker, dp rank, tier,
    group). Events of state/windowed groups are skipped; events of another block size than the
    index's unit only count stores of their hashes. Units whose KV depends on more than their
    tokens are held but never found: units with extra keys (images, the cache salt vLLM folds
    into a request's first block), every unit after one of those in its sequence, and units of
    another LoRA adapter than `lora_name`."""
    from vllm_kvbm_plugin.events.types import (
        MEDIUM_GPU,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        tier_of,
    )

    dp = batch.data_parallel_rank
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            if ev.kv_cache_spec_kind in _SKIP_KINDS:
                continue
            holder = (worker, dp, tier_of(ev), ev.group_idx)
            parent = ev.parent_block_hash
            unit = index.unit if ev.block_size == index.unit else 0
            other_lora = ev.lora_name != lora_name or (lora_name is None and ev.lora_id is not None)
            extra = ev.extra_keys or ()
            for i, h in enumerate(ev.block_hashes):
                toks = ev.token_ids[i * unit:(i + 1) * unit] if unit else None
                exclude = (other_lora or (i < len(extra) and extra[i] is not None)
                           or parent in index.excluded)
                index.add(h, toks if toks is not None and len(toks) == unit else None, parent, holder,
                          exclude=exclude)
                parent = h
        elif isinstance(ev, BlockRemoved):
            holder = (worker, dp, tier_of(ev), ev.group_idx)
            for h in ev.block_hashes:
                index.remove(h, holder)
        elif isinstance(ev, AllBlocksCleared):
            index.clear_holders(lambda x: x[0] == worker and x[1] == dp and x[2].medium == MEDIUM_GPU)


def match_recording(fp: IO[str], prompts: Iterable[Sequence[int]], unit: int | None = None) -> Iterable[dict]:
    """`vllm-kvbm match`: build the index from a recorded stream (JSON lines), then one JSON-ready
    dict per prompt (runs and metrics), and last {"index": stats}."""
    from vllm_kvbm_plugin.events import recording

    batches = [b for _, b in recording.read(fp)]
    unit = unit or event_unit(batches)
    if unit is None:
        raise ValueError("the recording has no BlockStored event with token ids: no unit to index")
    index = SubseqIndex(unit)
    for batch in batches:
        feed_batch(index, batch)
    index.warm_up()
    for tokens in prompts:
        m = index.find(tokens)
        yield {"prompt_tokens": len(tokens), "prefix_tokens": m.prefix_tokens,
               "reusable_tokens": m.reusable_tokens, "rejected": m.rejected,
               "probe_us": round(m.seconds * 1e6, 1),
               "runs": [{"new_start": r.new_start, "old_start": r.old_start, "length": r.length,
                         "keys": [k.hex() if isinstance(k, bytes) else k for k in r.keys]}
                        for r in m.runs]}
    yield {"index": {"unit": unit, "units": len(index), **index.stats}}
