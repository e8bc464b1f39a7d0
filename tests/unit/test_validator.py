import json

from vllm_kvbm_plugin import cli
from vllm_kvbm_plugin.events import recording
from vllm_kvbm_plugin.events.types import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_DISK,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Tier,
    storage_tier,
)
from vllm_kvbm_plugin.events.validator import Prompt, Validator


def stored(hashes, parent=None, bs=2, n_tokens=None, group=1, kind="full_attention", medium="GPU",
           locality=None, ownership=None):
    n = len(hashes) * bs if n_tokens is None else n_tokens
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(n)),
                       block_size=bs, lora_id=None, medium=medium, lora_name=None,
                       group_idx=group, kv_cache_spec_kind=kind, locality=locality, ownership=ownership)


def removed(hashes, group=1, medium="GPU", locality=None, ownership=None):
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group, locality=locality,
                        ownership=ownership)


def on_disk(tier_id):
    """The medium/locality/ownership of our disk tier's events."""
    t = storage_tier(tier_id)
    return {"medium": t.medium, "locality": t.locality, "ownership": t.ownership}


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
    v = run(stored([1]), stored([1], medium="CPU"), stored([1], **on_disk("a")), AllBlocksCleared(), stored([1]))
    assert v.errors == 0
    assert v.held(medium="CPU") == {1} and v.held(medium=MEDIUM_STORAGE) == {1}


# ---- tiers in vLLM's vocabulary: (medium, locality, ownership) ----------------------------------

def test_tier_labels():
    assert Tier("GPU").label == "GPU" and Tier("CPU").label == "CPU"
    assert storage_tier("disk-1f").label == "STORAGE:LOCAL:disk-1f"
    assert Tier(MEDIUM_STORAGE, LOCALITY_REMOTE).label == "STORAGE:REMOTE"
    assert Tier(MEDIUM_STORAGE, None, "x").label == "STORAGE:-:x"


def test_storage_tiers_with_other_ownership_or_locality_are_separate_indexes():
    a, b = on_disk("tier-a"), on_disk("tier-b")
    remote_a = dict(a, locality=LOCALITY_REMOTE)
    v = run(stored([1, 2], **a), stored([1, 2], **b), stored([1, 2], **remote_a),
            stored([3], parent=2, **b), removed([1, 2], **a))
    assert v.errors == 0, v.problems
    assert v.held(medium=MEDIUM_STORAGE, ownership="tier-a", locality=LOCALITY_LOCAL) == set()
    assert v.held(medium=MEDIUM_STORAGE, ownership="tier-b") == {1, 2, 3}
    assert v.held(medium=MEDIUM_STORAGE, ownership="tier-a", locality=LOCALITY_REMOTE) == {1, 2}
    assert v.held(medium=MEDIUM_STORAGE, locality=LOCALITY_LOCAL) == {1, 2, 3}
    tiers = v.report()["tiers"]
    assert tiers["STORAGE:LOCAL:tier-a"] == {"stored": 2, "removed": 2, "held": 0}
    assert tiers["STORAGE:LOCAL:tier-b"] == {"stored": 3, "removed": 0, "held": 3}
    assert tiers["STORAGE:REMOTE:tier-a"] == {"stored": 2, "removed": 0, "held": 2}
    # a parent held only by another tier is unknown: tiers do not share chains
    v = run(stored([1], **a), stored([2], parent=1, **b))
    assert v.counts["unknown_parent"] == 1 and v.problems[0].tier == "STORAGE:LOCAL:tier-b"


def test_removal_naming_another_ownership_or_no_ownership_is_unknown():
    a = on_disk("tier-a")
    v = run(stored([1], **a), removed([1], **on_disk("tier-b")))
    assert v.counts["unknown_removal"] == 1
    p = v.problems[0]
    assert p.tier == "STORAGE:LOCAL:tier-b" and "STORAGE:LOCAL:tier-b" in p.detail
    assert v.held(medium=MEDIUM_STORAGE) == {1}  # tier-a still holds it
    # a removal without the ownership does not reach the owned tier either
    assert run(stored([1], **a), removed([1], medium=MEDIUM_STORAGE)).counts["unknown_removal"] == 1
    assert run(stored([1], **a), removed([1], **a)).errors == 0


def test_mixed_gpu_cpu_storage_stream_validates():
    disk = on_disk("3b1c9e0f")
    v = run(stored([1, 2]),                                  # GPU prefix cache
            stored([1], medium="CPU"), stored([2], parent=1, medium="CPU"),   # CPU tier, one block per event
            stored([1], **disk), stored([2], parent=1, **disk),               # written through to disk
            removed([2], medium="CPU"), removed([1], medium="CPU"),  # evicted from CPU, leaf first
            removed([1, 2]),                                 # and from GPU
            AllBlocksCleared(),
            stored([1], medium="CPU"))                       # prefetched back from disk
    assert v.errors == 0, v.problems
    tiers = v.report()["tiers"]
    assert set(tiers) == {"GPU", "CPU", "STORAGE:LOCAL:3b1c9e0f"}
    assert tiers["STORAGE:LOCAL:3b1c9e0f"]["held"] == 2 and tiers["CPU"]["held"] == 1
    assert v.report()["stored_by"]["STORAGE/g1/full_attention/2"] == 2


def test_legacy_disk_stream_validates_as_its_own_medium():
    v = run(stored([1, 2]), stored([1], medium=MEDIUM_DISK), stored([2], parent=1, medium=MEDIUM_DISK),
            removed([2], medium=MEDIUM_DISK), AllBlocksCleared())
    assert v.errors == 0, v.problems
    assert v.held(medium=MEDIUM_DISK) == {1} and v.held(medium=MEDIUM_STORAGE) == set()
    assert v.report()["tiers"]["DISK"] == {"stored": 2, "removed": 1, "held": 1}
    # DISK is not STORAGE: a STORAGE removal of a DISK block is unknown
    assert run(stored([1], medium=MEDIUM_DISK), removed([1], **on_disk("a"))).counts["unknown_removal"] == 1


# ---- extra_keys against the prompts -------------------------------------------------------------
# Prompt tokens 100..111 in blocks of 4; image "imgA" on tokens [2, 7): blocks 0 (offset 2) and 1 (-2).
TOKENS = list(range(100, 112))
IMG_A = Prompt.from_json({"name": "a", "token_ids": TOKENS,
                          "images": [{"offset": 2, "length": 5, "identifier": "imgA"}]})
GOOD_KEYS = [[("imgA", 2)], [("imgA", -2)], None]


def mm_stored(hashes, extra_keys, parent=None, tokens=TOKENS, medium="GPU"):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=4, lora_id=None, medium=medium, lora_name=None,
                       extra_keys=extra_keys, group_idx=0, kv_cache_spec_kind="full_attention")


def run_prompts(prompts, *events):
    v = Validator(prompts=prompts)
    for i, e in enumerate(events):
        v.apply(KVEventBatch(ts=0.0, events=[e]), i)
    return v


def test_extra_keys_matching_the_prompts_pass():
    # one event for the chain, then the CPU tier's one block per event, chained through parents
    v = run_prompts([IMG_A], mm_stored([1, 2, 3], GOOD_KEYS),
                    *[mm_stored([h], [k], parent=h - 1 or None, tokens=TOKENS[4 * i:4 * i + 4], medium="CPU")
                      for i, (h, k) in enumerate(zip([1, 2, 3], GOOD_KEYS))])
    assert v.errors == 0
    assert v.report()["prompt_blocks"] == {"checked": 6, "with_images": 4}


def test_wrong_missing_or_extra_extra_keys_are_reported():
    for keys in ([[("imgA", 3)], [("imgA", -2)], None],       # wrong offset
                 [[("imgB", 2)], [("imgA", -2)], None],       # wrong identifier
                 [[("imgA", 2)], None, None],                 # missing entry
                 [[("imgA", 2)], [("imgA", -2)], [("imgA", -6)]],  # image on a block without one
                 [[("imgA", 2), ("imgA", 9)], [("imgA", -2)], None]):  # one image too many
        v = run_prompts([IMG_A], mm_stored([1, 2, 3], keys))
        assert v.counts["extra_keys"] == 1, keys
        assert v.report()["by_rule"]["extra_keys"] == 1
        assert "tokens [" in v.problems[0].detail
    # no extra_keys at all on an image block
    assert run_prompts([IMG_A], mm_stored([1, 2, 3], None)).counts["extra_keys"] == 2


def test_prompts_with_the_same_tokens_are_told_apart_by_their_images():
    img_b = Prompt.from_json({"name": "b", "token_ids": TOKENS,
                              "images": [{"offset": 2, "length": 5, "identifier": "imgB"}]})
    ok = run_prompts([IMG_A, img_b], mm_stored([1, 2, 3], [[("imgB", 2)], [("imgB", -2)], None]))
    assert ok.errors == 0
    # block 0 from one prompt, block 1 from the other: no prompt has this chain
    mixed = run_prompts([IMG_A, img_b], mm_stored([1, 2, 3], [[("imgA", 2)], [("imgB", -2)], None]))
    assert mixed.counts["extra_keys"] == 1


def test_an_image_without_identifier_keeps_one_along_the_chain():
    anon = Prompt.from_json({"token_ids": TOKENS, "images": [{"offset": 2, "length": 5}]})
    assert run_prompts([anon], mm_stored([1, 2, 3], [[("h1", 2)], [("h1", -2)], None])).errors == 0
    assert run_prompts([anon], mm_stored([1, 2, 3], [[("h1", 2)], [("h2", -2)], None])).counts["extra_keys"] == 1


def test_blocks_off_the_prompts_and_other_keys_are_not_checked():
    other = mm_stored([7], [[("imgA", 0)]], tokens=[1, 2, 3, 4])  # tokens of no prompt
    salted = mm_stored([1, 2, 3], [[("imgA", 2), "salt"], [("imgA", -2)], None])  # bare cache salt
    v = run_prompts([IMG_A], other, salted)
    assert v.errors == 0 and v.report()["prompt_blocks"]["checked"] == 3
    # without prompts the rule is off and the report keeps its old keys
    assert "prompt_blocks" not in run(mm_stored([1, 2, 3], None)).report()


def test_cli_validate_with_prompts(tmp_path, capsys):
    events, prompts = tmp_path / "events.jsonl", tmp_path / "prompts.jsonl"
    # the JSON recording turns tuples into lists, as on the wire
    events.write_text(recording.dump_line(0, KVEventBatch(ts=0.0, events=[mm_stored([1, 2, 3], GOOD_KEYS)])) + "\n")
    prompts.write_text(json.dumps({"token_ids": TOKENS, "images": [{"offset": 2, "length": 5, "identifier": "imgA"}]}) + "\n")
    assert cli.main(["validate", str(events), "--prompts", str(prompts)]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_blocks"]["with_images"] == 2
    prompts.write_text(json.dumps({"token_ids": TOKENS, "images": [{"offset": 3, "length": 5}]}) + "\n")
    assert cli.main(["validate", str(events), "--prompts", str(prompts)]) == 1
    assert json.loads(capsys.readouterr().out)["by_rule"]["extra_keys"] == 2  # both image blocks


def test_cli_validate_names_the_tier_of_each_problem(tmp_path, capsys):
    events = tmp_path / "events.jsonl"
    recording.write(open(events, "w"), [
        (0, KVEventBatch(ts=0.0, events=[stored([1, 2], **on_disk("tier-a"))])),
        (1, KVEventBatch(ts=0.0, events=[removed([2], **on_disk("tier-b")), removed([2], **on_disk("tier-a"))])),
    ])
    assert cli.main(["validate", str(events)]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["by_rule"]["unknown_removal"] == 1
    assert report["first_problems"][0]["tier"] == "STORAGE:LOCAL:tier-b"
    assert report["tiers"]["STORAGE:LOCAL:tier-a"] == {"stored": 2, "removed": 1, "held": 1}
    assert "#1 unknown_removal [STORAGE:LOCAL:tier-b]" in captured.err


def test_cli_validate_counts_reuse_reports_when_told(tmp_path, capsys):
    """Requests with kv_cache_report_mode "full" announce their hits again: duplicates for a plain
    check, reuse reports with --reuse-reports; a hash repeated within one event stays a problem."""
    events = tmp_path / "events.jsonl"
    recording.write(open(events, "w"), [
        (0, KVEventBatch(ts=0.0, events=[stored([1, 2])])),
        (1, KVEventBatch(ts=0.0, events=[stored([1, 2])])),  # the hit, reported again
    ])
    assert cli.main(["validate", str(events)]) == 1
    assert json.loads(capsys.readouterr().out)["by_rule"]["duplicate_store"] == 2
    assert cli.main(["validate", str(events), "--reuse-reports"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == 0 and report["reuse_reports"] == 2
    recording.write(open(events, "a"), [(2, KVEventBatch(ts=0.0, events=[stored([3, 3], parent=2)]))])
    assert cli.main(["validate", str(events), "--reuse-reports"]) == 1


def test_bare_tier_hashes_validate_in_any_group():
    """vLLM's offloading placeholders (block size 0, no tokens) of an attention or a Mamba group."""
    v = run(stored([1], bs=0, n_tokens=0, medium="CPU"), stored([2], bs=0, n_tokens=0, kind="mamba", medium="CPU"),
            removed([2], medium="CPU"))
    assert v.errors == 0
    assert run(stored([3], bs=0, n_tokens=4, kind="mamba", medium="CPU")).report()["by_rule"]["token_count"] == 1


def test_a_unit_may_chain_to_a_whole_block_but_not_the_other_way():
    """A partial tail of 2-token units after a whole 6-token chunk (vLLM's offloading connector)."""
    assert run(stored([1], bs=6, medium="CPU"), stored([2], parent=1, bs=2, medium="CPU")).errors == 0
    assert run(stored([1], bs=2, medium="CPU"), stored([2], parent=1, bs=6, medium="CPU")).errors == 1
    assert run(stored([1], bs=4, medium="CPU"), stored([2], parent=1, bs=6, medium="CPU")).errors == 1
