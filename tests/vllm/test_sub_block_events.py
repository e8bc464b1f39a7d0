"""Sub-block KV events on vLLM's real Scheduler and KVCacheManager (simulated model outputs)."""

import random

import pytest

from vllm_kvbm_plugin import patches, plugin
from vllm_kvbm_plugin.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from vllm_kvbm_plugin.events.validator import Validator
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness

ATTN = 1  # the full-attention group; group 0 is Mamba


def events(h, cls=BlockStored, group=ATTN, block_size=None):
    return [e for b in h.batches for e in b.events if isinstance(e, cls)
            and getattr(e, "group_idx", group) == group
            and (block_size is None or getattr(e, "block_size", None) == block_size)]


def validate(h):
    v = Validator()
    for i, b in enumerate(h.batches):
        v.apply(b, i)
    return v


def announced(h, block_size=32):
    return [x for e in events(h, block_size=block_size) for x in e.block_hashes]


def test_prompt_shorter_than_the_inflated_block_announces_its_units():
    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32))
    prompt = list(range(100, 200))
    h.add(prompt)
    h.run()
    units = h.unit_hashes(prompt)  # 3 full units of 32
    fine = events(h, block_size=32)
    assert len(fine) == 1, "one event for units 0..2; vLLM's own partial-tail event is dropped"
    assert fine[0].block_hashes == units[:3]
    assert fine[0].parent_block_hash is None
    assert fine[0].token_ids == prompt[:96]
    assert fine[0].kv_cache_spec_kind == "full_attention" and fine[0].extra_keys == [None] * 3
    assert validate(h).errors == 0


def test_long_prompt_units_are_chained_and_coarse_events_stay():
    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32))
    prompt = list(range(1000, 1400))
    h.add(prompt, max_tokens=2)
    h.run()
    units = h.unit_hashes(prompt)
    # prompt 400 -> full blocks 0,1 (units 0..9) and the partial tail up to 384 (units 10, 11)
    assert announced(h) == units[:12]
    assert [e.parent_block_hash for e in events(h, block_size=32)] == [None, units[9]]
    coarse = events(h, block_size=160)
    assert [x for e in coarse for x in e.block_hashes] == [units[4], units[9]]
    assert validate(h).errors == 0


def scenario(h, rng):
    """Shared prefixes, identical prompts in one batch, evictions and a reset."""
    a = [rng.randrange(2000) for _ in range(400)]
    h.add(a)
    h.add(a[:200] + [rng.randrange(2000) for _ in range(200)])
    h.run()
    h.add(a + [1, 2, 3])  # same prefix twice in one step: vLLM caches the hash in two blocks
    h.add(a + [4, 5, 6])
    h.run()
    for _ in range(12):  # working set larger than the cache: evictions
        h.add([rng.randrange(2000) for _ in range(rng.randrange(50, 700))])
        h.run()
    assert h.reset_prefix_cache()
    h.add(a)
    h.run()
    return a


def test_stream_is_consistent_through_duplicates_evictions_and_reset():
    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32, num_blocks=24))
    a = scenario(h, random.Random(1))
    v = validate(h)
    assert v.errors == 0, v.report()
    assert events(h, BlockRemoved), "the small cache must have evicted something"
    assert any(isinstance(e, AllBlocksCleared) for b in h.batches for e in b.events)
    # after the reset the 400-token prompt is announced again, units 0..11, chained from None
    flat = [e for b in h.batches for e in b.events]
    cleared = max(i for i, e in enumerate(flat) if isinstance(e, AllBlocksCleared))
    after = [e for e in flat[cleared:]
             if isinstance(e, BlockStored) and e.block_size == 32 and e.group_idx == ATTN]
    assert [x for e in after for x in e.block_hashes] == h.unit_hashes(a)[:12]


def test_without_the_plugin_vllm_reannounces_and_skips_short_prompts():
    """The difference the plugin makes, on the same scenario."""
    patches.remove_all()
    try:
        h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32, num_blocks=24))
        scenario(h, random.Random(1))
        v = validate(h)
        assert v.counts["duplicate_store"] > 0  # the same block hash announced twice
        assert v.counts["unknown_parent"] > 0  # partial-tail events chained to unannounced units
        h2 = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32))
        h2.add(list(range(100, 200)))
        h2.run()
        fine = events(h2, block_size=32)
        assert [len(e.block_hashes) for e in fine] == [1]  # only vLLM's partial tail: unit 2
        assert fine[0].parent_block_hash is not None
    finally:
        plugin.register()


def test_nemotron_like_geometry_under_pressure():
    # attention block 2176 tokens, hash unit 64, requests of 1k-16k tokens
    rng = random.Random(2)
    h = SchedulerHarness(HarnessConfig(block_size=2176, hash_block_size=64, num_blocks=30,
                                       max_model_len=20000, max_num_batched_tokens=8192))
    system = [rng.randrange(2000) for _ in range(3000)]
    for _ in range(30):
        n = rng.randrange(1000, 16000)
        body = [rng.randrange(2000) for _ in range(n)]
        h.add(system + body if rng.random() < 0.5 else body, max_tokens=3)
        if rng.random() < 0.3:
            h.run()
    h.run()
    v = validate(h)
    assert v.errors == 0, v.report()
    assert v.removed_hashes > 0
    assert set(h.unit_hashes(system)[:46]) <= set(announced(h, 64))


def test_coarse_events_can_be_suppressed(monkeypatch):
    monkeypatch.setenv("KVBM_COARSE_EVENTS", "0")
    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32, num_blocks=24))
    scenario(h, random.Random(3))
    assert events(h, block_size=160) == []
    assert events(h, block_size=32)
    assert validate(h).errors == 0


def test_single_group_models_are_untouched():
    def stream(h):
        return [(type(e).__name__, {k: getattr(e, k) for k in e.__struct_fields__})
                for b in h.batches for e in b.events]

    def run():
        h = SchedulerHarness(HarnessConfig(hybrid=False, block_size=32, num_blocks=30))
        scenario(h, random.Random(4))
        return stream(h)

    with_plugin = run()
    patches.remove_all()
    try:
        assert run() == with_plugin
    finally:
        plugin.register()


def test_events_off_attaches_nothing():
    h = SchedulerHarness(HarnessConfig(events=False))
    assert h.scheduler.kv_cache_manager.block_pool._kvbm_units is None


def test_vllms_objects_keep_their_attribute_layout():
    """Our wrappers keep their state in class-default attributes and never read a vLLM object's
    `__dict__`: on CPython 3.11 that turns the object's inline attribute values into a dict for
    good, and every attribute access of vLLM's on a BlockPool got ~3x slower (2.5% of a step)."""
    import gc

    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32, num_blocks=24))
    scenario(h, random.Random(5))
    pool = h.scheduler.kv_cache_manager.block_pool
    assert pool._kvbm_units is not None and validate(h).errors == 0
    # a materialized instance dict is one of the object's referents; inline values are not a dict
    assert not any(type(r) is dict and "kv_event_queue" in r for r in gc.get_referents(pool))


def test_patches_are_idempotent_and_removable():
    from vllm.v1.core.block_pool import BlockPool

    wrapped = BlockPool.cache_full_blocks
    assert patches.apply_all() == []  # already applied by the plugin
    assert BlockPool.cache_full_blocks is wrapped
    patches.remove_all()
    try:
        assert not hasattr(BlockPool.cache_full_blocks, "__kvbm_original__")
    finally:
        plugin.register()
    assert hasattr(BlockPool.cache_full_blocks, "__kvbm_original__")


def test_image_units_carry_vllms_extra_keys():
    """Per-unit events of an image request carry, for each unit, the image identifier and the
    offset of the image start from that unit's start, like vLLM's own events do for their blocks."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from vllm_kvbm_plugin.events.validator import Image, Prompt

    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32))
    prompt = list(range(100, 400))
    image = MultiModalFeatureSpec(data=None, modality="image", identifier="img-a", mm_hash="img-a",
                                  mm_position=PlaceholderRange(offset=40, length=50))
    h.add(prompt, mm_features=[image])
    h.run()
    fine = events(h, block_size=32)
    keys = [k for e in fine for k in e.extra_keys]
    # units 0..8 (block 0 and the prompt's tail up to 288): the image covers tokens 40..89
    assert keys[:4] == [None, [["img-a", 8]], [["img-a", -24]], None]
    assert all(k is None for k in keys[4:]) and len(keys) == 9
    assert [e.extra_keys for e in events(h, block_size=160)] == [[[["img-a", 40]]]]  # vLLM's own
    v = Validator(prompts=[Prompt(tuple(prompt), (Image(40, 50, "img-a"),))])
    for i, b in enumerate(h.batches):
        v.apply(b, i)
    assert v.errors == 0 and v.prompt_blocks["with_images"] >= 3, v.report()


def test_prompts_diverging_inside_a_block_announce_shared_units_once():
    """Two physical blocks sharing their first units (prompts that diverge inside a block): the
    shared units are announced with the first block, removed only when the last holder goes."""
    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32, num_blocks=24))
    rng = random.Random(5)
    a = [rng.randrange(2000) for _ in range(400)]
    b = a[:100] + [rng.randrange(2000) for _ in range(300)]
    h.add(a)
    h.run()
    h.add(b)
    h.run()
    ua, ub = h.unit_hashes(a), h.unit_hashes(b)
    assert ub[:3] == ua[:3] and ub[3] != ua[3]
    assert announced(h) == ua[:12] + ub[3:12]
    first_of_b = next(e for e in events(h, block_size=32) if ub[3] in e.block_hashes)
    assert first_of_b.block_hashes[0] == ub[3] and first_of_b.parent_block_hash == ua[2]
    assert [x for e in events(h, block_size=160) for x in e.block_hashes] == [
        ua[4], ua[9], ub[4], ub[9]]
    for _ in range(8):  # other prompts take every block: both holders of units 0..2 go
        h.add([rng.randrange(2000) for _ in range(600)])
        h.run()
    removed = [x for e in events(h, BlockRemoved) for x in e.block_hashes]
    # units 0..2 once though two blocks held them; unit 4 is also the block's coarse key
    assert [removed.count(x) for x in ua[:5] + ub[3:5]] == [1, 1, 1, 1, 2, 1, 2]
    v = validate(h)
    assert v.errors == 0, v.report()


def test_shared_prefix_of_holders_matches_a_unit_by_unit_count():
    """`_shared` (how many of a block's units other holders hold) against counting unit by unit,
    for holders that are prefixes, duplicates, or diverge anywhere inside the block."""
    from vllm_kvbm_plugin.events.unit_tracker import _shared

    rng = random.Random(7)
    for _ in range(2000):
        base = [rng.getrandbits(64) for _ in range(rng.randrange(1, 12))]

        def block():  # a prefix of base, then its own units (hashes chain: no re-agreement)
            keep = rng.randrange(1, len(base) + 1)
            return base[:keep] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 6))]

        units = block()
        holders = [(1, block()) for _ in range(rng.randrange(1, 6))]
        skip = rng.choice(holders + [None])

        def common(other):
            n = 0
            while n < min(len(units), len(other)) and units[n] == other[n]:
                n += 1
            return n

        expected = max([common(o) for e in holders if e is not skip for o in [e[1]]], default=0)
        assert _shared(units, holders, skip) == expected


def test_a_partial_block_extended_at_a_later_boundary_announces_only_its_new_units():
    """vLLM's real BlockPool given a block's partial key at 64 tokens, then at 128 (a longer prompt
    tail of the same block), then at 128 again (as at every later step): units 0..1, then only
    units 2..3 chained to unit 1, then nothing."""
    from vllm.distributed.kv_events import BlockStored as VllmStored

    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32))
    pool = h.scheduler.kv_cache_manager.block_pool
    prompt = list(range(300, 500))
    request = h.scheduler.requests[h.add(prompt)]
    block = pool.get_new_blocks(1)[0]
    for num_tokens in (64, 128, 128):
        pool.cache_partial_block(request, block, num_tokens, ATTN, 160)
    stored = [e for e in pool.take_events() if isinstance(e, VllmStored)]
    units = h.unit_hashes(prompt)
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == [
        (units[0:2], None, prompt[0:64]), (units[2:4], units[1], prompt[64:128])]


def test_chunked_prefill_chains_each_chunk_to_the_unit_before_it():
    """A prompt cached over several steps: each chunk's first coarse and unit events take their
    parent from the block the previous chunk cached (converted once, not again per event)."""
    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32, max_num_batched_tokens=320))
    prompt = list(range(5000, 6000))
    h.add(prompt, max_tokens=2)
    h.run()
    units = h.unit_hashes(prompt)
    fine, coarse = events(h, block_size=32), events(h, block_size=160)
    assert len(fine) >= 2 and len(coarse) >= 2, "the prompt is cached in several chunks"
    assert announced(h) == units[: len(announced(h))]
    assert all(e.parent_block_hash is not None for e in fine[1:] + coarse[1:])
    for e in fine:
        i = units.index(e.block_hashes[0])
        assert e.parent_block_hash == (units[i - 1] if i else None)
    for e in coarse:
        i = units.index(e.block_hashes[0])
        assert e.parent_block_hash == (units[i - 5] if i >= 5 else None)
    assert validate(h).errors == 0


@pytest.mark.parametrize("size", [8, 16, 32])
def test_event_hashes_match_vllms_conversion(size):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from vllm_kvbm_plugin import compat

    rng = random.Random(size)
    convert = compat.event_hash_converter()
    for n in (0, 1, 3, 40, 40, 128, 300):  # past compat._UNPACK_MAX: unpacked in pieces
        hashes = [rng.randbytes(size) for _ in range(n)]
        assert convert(hashes) == [maybe_convert_block_hash(x) for x in hashes]


@pytest.mark.parametrize("coarse", ["1", "0"])
def test_a_full_report_reannounces_a_hit_per_unit(monkeypatch, coarse):
    # kv_cache_report_mode "full" (sampling extra_args): vLLM announces again the blocks a request
    # hit in the prefix cache. The hit here ends inside block 2 (the first prompt's last boundary,
    # 384 tokens): vLLM alone would index the Mamba group's hash of block 2, which the new prompt
    # (440 tokens) does not have (IndexError in the scheduler).
    monkeypatch.setenv("KVBM_COARSE_EVENTS", coarse)
    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32))
    prompt = list(range(1000, 1400))
    h.add(prompt, max_tokens=1)
    h.run()
    before = len(h.batches)
    h.add(prompt + [7] * 40, max_tokens=1, extra_args={"kv_cache_report_mode": "full"})
    h.step()
    units = h.unit_hashes(prompt)
    stored = [e for b in h.batches[before:] for e in b.events if isinstance(e, BlockStored)]
    again = [(e.group_idx, e.block_size, e.block_hashes, e.parent_block_hash) for e in stored
             if e.parent_block_hash is None]  # the hit, from the first block; new blocks chain to it
    mamba = [(0, 160, [units[4], units[9]], None)]  # vLLM's, for the 2 whole blocks hit
    coarse_units = [(ATTN, 160, [units[4], units[9]], None)] if coarse == "1" else []
    assert again == mamba + coarse_units + [(ATTN, 32, units[:12], None)]
    assert stored[len(again)].parent_block_hash is not None  # then what the request computes
    # a router-like check sees the hit announced again: duplicates, unless told to expect reports
    plain, reports = Validator(), Validator(reuse_reports=True)
    for b in h.batches:
        plain.apply(b)
        reports.apply(b)
    dups = plain.counts["duplicate_store"]
    assert dups >= 12 and plain.errors == dups  # at least the hit's 12 units
    assert reports.errors == 0 and reports.reuse_reports == dups
    assert reports.report()["reuse_reports"] == dups and "reuse_reports" not in plain.report()


def test_requests_keep_their_hashes_in_event_form_through_truncation():
    """Hashes are converted as vLLM computes them; when vLLM truncates a request's hashes
    (streaming input sessions, resets) the tracker converts afresh until vLLM hashes again, and
    the kept list then follows."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    h = SchedulerHarness(HarnessConfig(block_size=160, hash_block_size=32))
    tracker = h.scheduler.kv_cache_manager.block_pool._kvbm_units
    prompt = list(range(1000, 1000 + 32 * 7 + 5))
    req = h.scheduler.requests[h.add(prompt, max_tokens=40)]

    def vllms():
        return [maybe_convert_block_hash(x) for x in req.block_hashes]

    kept = req._kvbm_event_hashes
    assert len(kept) == 7 and kept == vllms()
    assert all(x is y for x, y in zip(tracker.event_hashes(req, 2, 7), kept[2:7]))  # a slice, not converted
    del req.block_hashes[3:]
    fresh = tracker.event_hashes(req, 0, 3)
    assert fresh == vllms() and fresh[0] is not kept[0] and len(kept) == 7  # converted afresh
    req.append_output_token_ids(list(range(5000, 5000 + 32)))  # vLLM hashes units 3..7 again
    assert req._kvbm_event_hashes is kept and kept == vllms() and len(kept) == 8
    assert all(x is y for x, y in zip(tracker.event_hashes(req, 2, 8), kept[2:8]))
    req.block_hashes.clear()
    req.update_block_hashes()
    assert kept == vllms() and len(kept) == 8
