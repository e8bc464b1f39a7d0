"""patches/offload_events.py on vLLM's own OffloadingEventsTracker (0.32 and 0.33): one batch's
tier stores come out parents first, and a chunk the tracker has no payload for (a Mamba state, a
restart index) names its group's kind. (Image extra_keys: tests/engine/test_offloading_multimodal.py.)"""

import hashlib

from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
    _OffloadEventMetadata,
)
from vllm.v1.kv_offload.base import Medium, OffloadingEvent, OffloadingKVEventsConfig, make_offload_key

from vllm_kvbm_plugin import compat

ATTENTION, MAMBA = OffloadingEventGroupSpec("full_attention", None), OffloadingEventGroupSpec("mamba", None)


def tracker(group_specs: dict) -> OffloadingEventsTracker:
    """A self-describing tracker that knows its groups, as the OffloadingConnector's scheduler builds
    it (0.33 passes the specs; on 0.32 our wrapper of the scheduler's __init__ sets them)."""
    config = OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=True)
    if compat.offloading_placeholders_have_kind():
        return OffloadingEventsTracker(config, group_specs=group_specs)
    t = OffloadingEventsTracker(config)
    t._kvbm_group_specs = group_specs
    return t


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def test_stores_of_one_batch_come_parents_first():
    t = tracker({0: ATTENTION})
    names = ["a", "b", "c", "d"]  # a <- b <- c <- d, one 4-token block each
    keys = {}
    for i, n in enumerate(names):
        keys[n] = make_offload_key(digest(n), 0)
        t._pending_event_metadata[keys[n]] = _OffloadEventMetadata(
            block_hashes=(digest(n),), parent_block_hash=digest(names[i - 1]) if i else None,
            token_ids=(i,) * 4, block_size=4, lora_id=None, lora_name=None, extra_keys=None, group_idx=0,
            kv_cache_spec=ATTENTION, active_residencies={(Medium.CPU, None)})
    order = [keys[n] for n in ("c", "a", "d", "b")]  # the manager's order
    out = list(t.take_events([OffloadingEvent(keys=order, medium=Medium.CPU, removed=False)]))
    firsts = [e.block_hashes[0] for e in out]
    want = [int.from_bytes(digest(n)[-8:], "big") for n in names]
    assert all(isinstance(e, BlockStored) for e in out) and firsts == want


def test_a_chunk_without_payload_names_its_groups_kind():
    t = tracker({0: ATTENTION, 1: MAMBA})
    out = list(t.take_events([OffloadingEvent(keys=[make_offload_key(digest("s"), 1), make_offload_key(digest("k"), 0)],
                                              medium=Medium.STORAGE, removed=False, ownership="kvbm-disk:x")]))
    assert [(e.group_idx, e.kv_cache_spec_kind, e.block_size) for e in out] == [(1, "mamba", 0), (0, "full_attention", 0)]


def test_a_salted_requests_tier_events_carry_what_its_gpu_events_carry():
    """Through vLLM's OffloadingConnector with KVBMOffloadingSpec (our payload builder and
    announcer): each CPU-tier block of a salted request names the extra keys (the salt, on its
    first block) and tokens of the same block's GPU event (~2 s)."""
    from vllm_kvbm_plugin.events import types as events
    from vllm_kvbm_plugin.testing.offloading_scheduler import OffloadingHarness, OffloadingHarnessConfig

    h = OffloadingHarness(OffloadingHarnessConfig(hybrid=False, block_size=16, hash_block_size=None,
                                                  offloading={"cpu_bytes_to_use": 8 << 20}))
    try:
        h.add(list(range(100, 260)), max_tokens=2, cache_salt="tenant-a")
        h.run(timeout=60)
        h.settle()
        stored = [e for b in h.batches for e in b.events if isinstance(e, events.BlockStored)]
    finally:
        h.close()
    gpu = {}  # hash -> (extra keys, tokens) of its GPU event
    for e in stored:
        if e.medium == "GPU":
            for i, block in enumerate(e.block_hashes):
                gpu[block] = (e.extra_keys[i] if e.extra_keys else None, e.token_ids[16 * i: 16 * i + 16])
    cpu = [e for e in stored if e.medium == "CPU"]
    assert len(cpu) == 10 and [e.extra_keys for e in cpu if e.extra_keys] == [[["tenant-a"]]]
    for e in cpu:
        assert (e.extra_keys[0] if e.extra_keys else None, e.token_ids) == gpu[e.block_hashes[0]]
