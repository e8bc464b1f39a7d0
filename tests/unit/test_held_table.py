"""events.held_table: the router index's numba tables against a plain Python model (store counts per
(hash, holder)) under random stores, removals and clears that grow the tables, collide, delete
mid-run and pass 64 holders; and the index on them (match_keys, digests as bytes, > 64 holders)."""

import random
from collections import Counter

import numpy as np
import pytest

from vllm_kvbm_plugin.events.held_table import REMOVE, STORE, HeldTable, hash_key, hash_keys
from vllm_kvbm_plugin.events.index import KVIndex
from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher
from vllm_kvbm_plugin.events.types import BlockStored, KVEventBatch


def check(table: HeldTable, model: Counter, holders: int, keys: list) -> None:
    """Every key's holder bits, every holder's keys and the table's size as the model says."""
    held = {k for (k, _), c in model.items() if c > 0}
    assert len(table) == len(held)
    masks = np.zeros((len(keys), table.words), np.uint64)
    table.lookup(np.array(keys, np.uint64), masks)
    for k, row in zip(keys, masks):
        want = [hid for hid in range(holders) if model[(k, hid)] > 0]
        got = [hid for hid in range(holders) if int(row[hid // 64]) >> (hid % 64) & 1]
        assert got == want, k
    for hid in range(holders):
        assert table.held_by([hid]) == {k for (k, h), c in model.items() if h == hid and c > 0}


@pytest.mark.parametrize("holders", [3, 70])
def test_random_stores_removals_and_clears_match_a_dict(holders):
    rng = random.Random(holders)
    table = HeldTable()
    for hid in range(holders):
        table.add_holder(hid)
    # a small key space: many repeats (counts), removals of held and unheld keys, long probe runs;
    # keys near 2**64 and 0 too
    keys = [rng.getrandbits(64) for _ in range(3000)] + [0, 1, 2**64 - 1]
    model: Counter = Counter()
    unknown = 0
    for _ in range(40):
        runs, flat = [], []
        for _ in range(rng.randrange(1, 6)):
            hid, op = rng.randrange(holders), rng.choice([STORE, STORE, REMOVE])
            run = [rng.choice(keys) for _ in range(rng.randrange(0, 400))]
            for k in run:
                if op == STORE:
                    model[(k, hid)] += 1
                elif model[(k, hid)] > 0:
                    model[(k, hid)] -= 1
                else:
                    unknown += 1
            flat += run
            runs.append((len(flat), hid, op))
        table.apply(np.array(flat, np.uint64), np.array([r[0] for r in runs], np.int64),
                    np.array([r[1] for r in runs], np.int64), np.array([r[2] for r in runs], np.int8))
        if rng.random() < 0.1:
            hid = rng.randrange(holders)
            table.clear(hid)
            for k in keys:
                model[(k, hid)] = 0
    assert len(table.held.rows) > 4096  # it grew
    assert table.words == (holders + 63) // 64
    assert table.unknown_removals == unknown
    check(table, model, holders, keys)


def test_hash_keys_are_vllms_int_form():
    digest = bytes(range(32))
    assert hash_key(digest) == int.from_bytes(digest[-8:], "big")
    assert hash_keys([digest, digest[::-1]]).tolist() == [hash_key(digest), hash_key(digest[::-1])]
    assert hash_keys([5, 2**64 - 1]).tolist() == [5, 2**64 - 1]
    assert hash_keys([-1]).tolist() == [2**64 - 1]


def stored(hashes, bs, group=1, kind="full_attention", parent=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[], block_size=bs,
                       lora_id=None, medium="GPU", lora_name=None, group_idx=group, kv_cache_spec_kind=kind)


@pytest.mark.parametrize("as_int", [True, False])
def test_match_keys_equals_match_and_digests_as_bytes_are_found(as_int):
    """Events carrying digests (bytes) or vLLM's ints: a prompt matched from its tokens and from
    its pre-hashed keys gives the same hits, hybrid and past 64 holders (70 workers)."""
    rng = random.Random(1)
    h = PromptHasher()
    prompts = [[rng.randrange(10, 5000) for _ in range(640)] for _ in range(70)]
    index = KVIndex()
    for w, p in enumerate(prompts):
        hs = h.event_hashes(p, 32, as_int=as_int)
        cut = 5 + w % 14  # units held: worker w holds a prefix of its prompt
        index.apply(f"w{w}", KVEventBatch(0.0, [stored(hs[:cut], 32),
                                                stored(hs[4:cut:5], 160, group=0, kind="mamba")]), 0)
    assert index.table.words == 3  # 140 holders
    for w in (0, 33, 69):
        p = prompts[w]
        keys = np.array(h.event_hashes(p, 32), np.uint64)
        by_keys = index.match_keys(keys, len(p), 32)
        assert by_keys == index.match(p)
        cut = 5 + w % 14
        want = max(range(5, cut + 1, 5), default=0) * 32  # the last state within the held prefix
        assert by_keys[(f"w{w}", None)].tokens == want
        assert all(m.tokens == 0 for k, m in by_keys.items() if k != (f"w{w}", None))
