from vllm_kvbm_plugin.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm_kvbm_plugin.events.validator import Validator


def stored(hashes, parent=None, bs=2, n_tokens=None, group=1, kind="full_attention", medium="GPU"):
    n = len(hashes) * bs if n_tokens is None else n_tokens
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(n)),
                       block_size=bs, lora_id=None, medium=medium, lora_name=None,
                       group_idx=group, kv_cache_spec_kind=kind)


def removed(hashes, group=1, medium="GPU"):
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


def run(*events):
    v = Validator()
    for i, e in enumerate(events):
        v.apply(KVEventBatch(ts=0.0, events=[e]), i)
    return v


def test_clean_chain_has_no_errors():
    v = run(stored([1, 2]), stored([3], parent=2), removed([3]), removed([1, 2]))
    assert v.errors == 0
    assert v.report()["held_hashes"] == 0


def test_each_rule_is_reported():
    assert run(stored([5], parent=4)).counts["unknown_parent"] == 1
    assert run(stored([1]), stored([1])).counts["duplicate_store"] == 1
    assert run(stored([1, 1])).counts["duplicate_store"] == 1  # repeated inside one event
    assert run(removed([9])).counts["unknown_removal"] == 1
    assert run(stored([1, 2], n_tokens=3)).counts["token_count"] == 1


def test_indexes_are_per_medium_group_and_block_size():
    # same hash on another medium, group or block size is not a duplicate
    v = run(stored([1]), stored([1], medium="CPU"), stored([1], group=0), stored([1], bs=4))
    assert v.errors == 0
    # a parent held only at another block size is unknown
    assert run(stored([1], bs=4), stored([2], parent=1, bs=2)).counts["unknown_parent"] == 1


def test_removal_takes_the_largest_block_size_first():
    # coarse block (size 4) and its last unit (size 2) share hash 2
    v = run(stored([1, 2]), stored([2], bs=4), removed([2]))
    assert v.held(block_size=4) == set() and v.held(block_size=2) == {1, 2}
    v.apply(KVEventBatch(ts=0.0, events=[removed([1, 2])]))
    assert v.errors == 0


def test_sparse_kinds_allow_missing_parents_and_fewer_hashes():
    v = run(stored([7], parent=3, n_tokens=8, bs=2, group=0, kind="mamba"))
    assert v.errors == 0
    assert run(stored([7], n_tokens=3, bs=2, group=0, kind="mamba")).counts["token_count"] == 1


def test_all_blocks_cleared_clears_gpu_only():
    v = run(stored([1]), stored([1], medium="CPU"), AllBlocksCleared(), stored([1]))
    assert v.errors == 0
    assert v.held(medium="CPU") == {1}
