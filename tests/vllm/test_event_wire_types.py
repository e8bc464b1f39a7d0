"""Our msgspec mirrors against vLLM's real event classes: what vLLM encodes we decode field for field,
and what we encode again vLLM decodes to the batch it sent (0.32 here; 0.33 where it is installed,
with `lookahead_token_ids`)."""

import msgspec
import pytest
from vllm.distributed import kv_events as vk

from vllm_kvbm_plugin.events import types as ours
from vllm_kvbm_plugin.events.recording import dump_line, read

HAS_LOOKAHEAD = "lookahead_token_ids" in vk.BlockStored.__struct_fields__


def vllm_batch(hash_type=int):
    h = (lambda i: i) if hash_type is int else (lambda i: i.to_bytes(32, "big"))
    lookahead = {"lookahead_token_ids": [[7, 8], [9, 10]]} if HAS_LOOKAHEAD else {}
    return vk.KVEventBatch(ts=12.5, data_parallel_rank=1, events=[
        vk.BlockStored(block_hashes=[h(1), h(2**64 - 1)], parent_block_hash=None, token_ids=list(range(8)),
                       block_size=4, lora_id=None, medium=vk.MEDIUM_GPU, lora_name=None,
                       extra_keys=[("img", -3), None], group_idx=0, kv_cache_spec_kind="full_attention",
                       session_id="req-1", **lookahead),
        vk.BlockStored(block_hashes=[h(3)], parent_block_hash=h(2**64 - 1), token_ids=[1, 2, 3, 4],
                       block_size=4, lora_id=7, medium=vk.MEDIUM_STORAGE, lora_name="lora-a",
                       group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128,
                       locality="LOCAL", ownership="disk-0f3a"),
        vk.BlockRemoved(block_hashes=[h(3)], medium=vk.MEDIUM_STORAGE, group_idx=1, locality="LOCAL",
                        ownership="disk-0f3a"),
        vk.BlockRemoved(block_hashes=[h(1)], medium=vk.MEDIUM_CPU),
        vk.AllBlocksCleared(),
    ])


def fields(ev) -> dict:
    return {"type": type(ev).__name__, **msgspec.structs.asdict(ev)}


def test_our_names_are_vllms():
    assert (ours.MEDIUM_GPU, ours.MEDIUM_CPU, ours.MEDIUM_STORAGE) == (vk.MEDIUM_GPU, vk.MEDIUM_CPU, vk.MEDIUM_STORAGE)
    from vllm.v1.kv_offload.base import Locality
    assert (ours.LOCALITY_LOCAL, ours.LOCALITY_REMOTE) == (Locality.LOCAL.value, Locality.REMOTE.value)
    # every field vLLM's events have, ours have (a missing one would be dropped silently on decode)
    for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        assert set(getattr(vk, name).__struct_fields__) <= set(getattr(ours, name).__struct_fields__), name


@pytest.mark.parametrize("hash_type", [int, bytes])
def test_vllm_encoded_batches_decode_and_round_trip(hash_type):
    sent = vllm_batch(hash_type)
    wire = msgspec.msgpack.encode(sent)
    got = ours.decode_batch(wire)
    assert (got.ts, got.data_parallel_rank) == (sent.ts, sent.data_parallel_rank)
    expected = [fields(e) for e in sent.events]
    for e in expected:  # msgpack has no tuples
        if e.get("extra_keys"):
            e["extra_keys"] = [list(k) if k is not None else None for k in e["extra_keys"]]
    assert [{k: v for k, v in fields(e).items() if k in x} for e, x in zip(got.events, expected)] == expected
    assert ours.tier_of(got.events[1]) == ours.storage_tier("disk-0f3a")
    # and back: our encoding carries the same maps (the header width may differ: msgspec sizes it
    # by the number of fields the class has, and ours has 0.33's extra one)
    assert msgspec.msgpack.decode(ours.encode_batch(got)) == msgspec.msgpack.decode(wire)
    back = msgspec.msgpack.decode(ours.encode_batch(got), type=vk.KVEventBatch)
    assert [fields(e) for e in back.events] == [fields(e) for e in
                                                msgspec.msgpack.decode(wire, type=vk.KVEventBatch).events]
    # a recording keeps every field
    assert list(read([dump_line(4, got)])) == [(4, got)]


def test_033_block_stored_decodes_and_older_decoders_ignore_the_new_field():
    """0.33 appends lookahead_token_ids to BlockStored: ours keeps it; a 0.32 reader skips it."""
    ev = msgspec.structs.asdict(vllm_batch().events[0])
    ev["lookahead_token_ids"] = [[7, 8], [9, 10]]
    wire = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", **ev}], 0])
    got = ours.decode_batch(wire).events[0]
    assert got.lookahead_token_ids == [[7, 8], [9, 10]] and got.block_hashes == [1, 2**64 - 1]
    theirs = msgspec.msgpack.decode(wire, type=vk.KVEventBatch).events[0]
    assert theirs.block_hashes == got.block_hashes
