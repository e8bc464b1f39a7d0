"""reuse.subseq_*: the sub-sequence index finds stored units at any offset of a request (kernels vs.
the plain-Python reference), rejects forged hash collisions, forgets removed units exactly, and
builds from recorded KV event streams (library and `vllm-kvbm match`)."""

import json
import random

import numpy as np
import pytest

from vllm_kvbm_plugin import cli
from vllm_kvbm_plugin.events import recording
from vllm_kvbm_plugin.events.types import (
    TIER_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm_kvbm_plugin.reuse.subseq_feed import event_unit, feed_batch
from vllm_kvbm_plugin.reuse.subseq_index import Run, SubseqIndex
from vllm_kvbm_plugin.reuse.subseq_kernels import DEFAULT_BASE, MIX, mixed_hashes, window_hashes
from vllm_kvbm_plugin.testing.subseq_reference import coverage, reference_find, reference_window_hashes

rng = random.Random(12)


def toks(n, hi=32000):
    return [rng.randrange(hi) for _ in range(n)]


def store_sequence(index, name, tokens, unit, parent=None):
    """Store tokens as a chain of units keyed (name, i) after `parent`; returns the keys."""
    keys = []
    for i in range(len(tokens) // unit):
        key = (name, i)
        index.add(key, tokens[i * unit:(i + 1) * unit], parent)
        keys.append(key)
        parent = key
    return keys


def test_window_hashes_match_reference():
    for unit in (1, 3, 16):
        t = toks(100) + [0, -5, 2**62, -(2**63)]
        assert [int(h) for h in window_hashes(np.array(t, np.int64), unit, np.uint64(DEFAULT_BASE))] \
            == reference_window_hashes(t, unit)
    assert len(window_hashes(np.array([1, 2], np.int64), 3, np.uint64(DEFAULT_BASE))) == 0


def test_probe_hashes_from_prefix_sums_match_reference():
    """find hashes windows as (R[s+unit] - R[s]) * base**(unit-1+s) with R the prefix sums of
    t[j] * base**-j (no serial multiply chain); it must equal the rolling hash (times the mixing
    constant), also for extreme token ids and after the power tables grow."""
    for unit, base in ((1, DEFAULT_BASE), (3, 31), (16, DEFAULT_BASE)):
        index = SubseqIndex(unit, base=base)
        for n in (0, unit - 1, unit, 100, 1000):  # the tables grow on the longer requests
            t = (toks(n) + [0, -5, 2**62, -(2**63)])[:n]
            index.find(t)
            got = mixed_hashes(np.array(t, np.int64), unit, index.inv_pow, index.mix_pow)
            assert [int(h) for h in got] == [h * int(MIX) % 2**64 for h in reference_window_hashes(t, unit, base)]
    with pytest.raises(ValueError, match="odd"):
        SubseqIndex(4, base=32)


def test_unaligned_and_reordered_documents():
    """RAG shape: documents stored in one order, requested in another behind another preamble."""
    unit = 16
    docs = [toks(100) for _ in range(3)]
    stored = toks(37) + docs[0] + docs[1] + docs[2]
    index = SubseqIndex(unit)
    store_sequence(index, "s", stored, unit)
    request = toks(5) + docs[2] + toks(3) + docs[0] + docs[1] + toks(9)
    m = index.find(request)
    assert m.runs == reference_find(index.units(), request, unit)
    # every stored unit lying wholly inside a document is found, at its new offset
    for d, doc in enumerate(docs):
        old_doc = 37 + 100 * d
        new_doc = [i for i in range(len(request)) if request[i:i + 100] == doc][0]
        inside = [u for u in range(len(stored) // unit)
                  if u * unit >= old_doc and (u + 1) * unit <= old_doc + 100]
        for u in inside:
            assert any(r.new_start + (k * unit) == new_doc + u * unit - old_doc
                       and r.keys[k] == ("s", u) and r.old_start + k * unit == u * unit
                       for r in m.runs for k in range(len(r.keys))), (d, u)
    # docs 0 and 1 are adjacent in both: all 11 units inside [37, 237) form one run across the seam
    longest = max(m.runs, key=lambda r: r.length)
    assert (longest.old_start, longest.length) == (48, 176) and request[longest.new_start:longest.new_start + longest.length] \
        == stored[longest.old_start:longest.old_start + longest.length]
    assert m.prefix_tokens == 0 and m.reusable_tokens == sum(r.length for r in m.runs)


def test_prefix_and_reusable_metrics():
    unit = 8
    a, b = toks(64), toks(40)
    index = SubseqIndex(unit)
    store_sequence(index, "a", a, unit)
    store_sequence(index, "b", toks(8) + b, unit)
    request = a[:32] + toks(4) + b + a[:16]
    m = index.find(request)
    assert m.runs == reference_find(index.units(), request, unit)
    assert m.prefix_tokens == 32
    # b's 5 units at offset 36, and a's first two units again at the end
    assert m.reusable_tokens == 40 + 16
    assert index.stats["prefix_tokens"] == 32 and index.stats["requests"] == 1


@pytest.mark.parametrize("unit,vocab", [(4, 6), (3, 2)])
def test_random_streams_match_reference_with_removals(unit, vocab):
    """Many shared fragments (equal hashes), sequences branching off stored units (several
    children), removals and re-adds: kernels, table deletions, links and the next-unit shortcut
    agree with the brute-force reference after every step. Small vocabularies: many repeated
    windows, many candidates per offset, many units with the same tokens."""
    index = SubseqIndex(unit, capacity=4)  # grows several times
    live = []
    for step in range(60):
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(4, 40))]
        branch_from = rng.choice(live) if live and step % 3 == 0 else None
        live.extend(store_sequence(index, step, seq, unit, branch_from))
        for key in rng.sample(live, len(live) // 4):
            index.remove(key)
            live.remove(key)
        request = [rng.randrange(vocab) for _ in range(rng.randrange(0, 80))]
        m = index.find(request)
        assert m.runs == reference_find(index.units(), request, unit), step
        assert (m.prefix_tokens, m.reusable_tokens) == coverage(m.runs, len(request))
        assert m.rejected == 0
    assert len(index) == len(live)


def test_removed_unit_is_no_longer_found_and_splits_its_run():
    unit = 8
    seq = toks(80)
    index = SubseqIndex(unit)
    keys = store_sequence(index, "s", seq, unit)
    request = toks(3) + seq[8:72]
    assert [r.length for r in index.find(request).runs] == [64]
    index.remove(keys[4])
    runs = index.find(request).runs
    assert keys[4] not in {k for r in runs for k in r.keys}
    assert [(r.new_start, r.old_start, r.length) for r in runs] == [(3, 8, 24), (35, 40, 32)]
    # re-stored under the same key with the same parent: the run is whole again
    index.add(keys[4], seq[32:40], keys[3])
    assert [r.length for r in index.find(request).runs] == [64]


def test_store_counts_per_holder():
    unit = 4
    index = SubseqIndex(unit)
    t = toks(4)
    index.add("k", t, None, holder="gpu")
    index.add("k", t, None, holder="gpu")
    index.add("k", t, None, holder="cpu")
    index.remove("k", "gpu")
    index.remove("k", "cpu")
    assert index.find(t).runs  # one GPU store left
    index.remove("k", "gpu")
    assert not index.find(t).runs and len(index) == 0
    assert not index.remove("k", "gpu") and index.stats["unknown_removals"] == 1


def test_child_stored_before_parent_gets_linked_and_placed():
    unit = 4
    seq = toks(12)
    index = SubseqIndex(unit)
    index.add(2, seq[8:12], 1)
    index.add(1, seq[4:8], 0)
    assert [r.old_start for r in index.find(seq).runs] == [-1]  # chain not rooted yet
    index.add(0, seq[0:4], None)
    assert index.find(seq).runs == [Run(0, 0, 12, (0, 1, 2))]


def test_forged_collision_is_rejected():
    """Two different windows with the same rolling hash: the hash proposes, the tokens decide."""
    unit = 8
    stored = toks(unit)
    mask = (1 << 64) - 1
    # t0*B^7 + t1*B^6 + ...: adding 1 to t0 and subtracting B from t1 leaves the hash unchanged
    forged = list(stored)
    forged[0] += 1
    d = (forged[1] - DEFAULT_BASE) & mask
    forged[1] = d - (1 << 64) if d >= 1 << 63 else d
    assert forged != stored
    assert reference_window_hashes(forged, unit) == reference_window_hashes(stored, unit)
    index = SubseqIndex(unit)
    index.add("doc", stored)
    m = index.find(toks(5) + forged + toks(5))
    assert m.runs == [] and m.rejected == 1 and index.stats["rejected"] == 1
    assert index.find(toks(5) + stored).runs == [Run(5, 0, unit, ("doc",))]


def test_next_unit_shortcut_sees_duplicates_and_forgeries():
    """A window one unit after a hit is checked against the hit's only child first, without the
    table. That must still find every other unit with the same tokens (duplicates, also after
    one is removed) and reject a child whose hash matches but whose tokens do not."""
    unit = 8
    u0, u1 = toks(unit), toks(unit)
    index = SubseqIndex(unit)
    index.add("a0", u0)
    index.add("a1", u1, "a0")
    request = toks(3) + u0 + u1
    assert index.find(request).runs == [Run(3, 0, 16, ("a0", "a1"))]
    index.add("b", u1)  # the same tokens as a1 under another key: found too
    index.add("c", u1, "x")  # and again, under a parent that is not stored
    m = index.find(request)
    assert m.runs == reference_find(index.units(), request, unit)
    assert sorted(r.keys for r in m.runs) == [("a0", "a1"), ("b",), ("c",)]
    index.remove("b")
    index.remove("c")
    assert index.find(request).runs == [Run(3, 0, 16, ("a0", "a1"))]
    # a0's only child is now a forgery of u1: same hash, other tokens
    forged = list(u1)
    forged[0] += 1
    d = (forged[1] - DEFAULT_BASE) & ((1 << 64) - 1)
    forged[1] = d - (1 << 64) if d >= 1 << 63 else d
    index.remove("a1")
    index.add("f", forged, "a0")
    m = index.find(request)
    assert m.runs == [Run(3, 0, 8, ("a0",))] and m.rejected == 1
    # with the true child stored again a0 has two children: the table decides, the same way
    index.add("a1", u1, "a0")
    m = index.find(request)
    assert m.runs == [Run(3, 0, 16, ("a0", "a1"))] and m.rejected == 1


def test_forged_collision_with_in_vocabulary_tokens_is_rejected():
    """A weak base (31) lets ordinary token ids collide; the token check still rejects them."""
    unit = 4
    stored = [100, 200, 300, 400]
    forged = [101, 200 - 31, 300, 400]
    assert reference_window_hashes(forged, unit, 31) == reference_window_hashes(stored, unit, 31)
    index = SubseqIndex(unit, base=31)
    index.add("doc", stored)
    m = index.find(forged + stored)
    assert m.rejected == 1 and m.runs == [Run(4, 0, 4, ("doc",))]


def test_wrong_unit_length_is_an_error():
    with pytest.raises(ValueError, match="unit"):
        SubseqIndex(4).add("k", [1, 2, 3])


# ---- from KV events -----------------------------------------------------------------------------

def stored_event(hashes, parent, tokens, bs, **kw):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=bs, lora_id=None, medium=kw.pop("medium", "GPU"), lora_name=None, **kw)


def recorded_stream(unit=16):
    """A vLLM-like stream: two prompts stored on the GPU (one also on the CPU tier), a coarse
    event at 4x the unit announcing one of the hashes again, an eviction and a reset."""
    a, b = toks(8 * unit), toks(4 * unit)
    ha = [1000 + i for i in range(8)]
    hb = [2000 + i for i in range(4)]
    batches = [
        KVEventBatch(1.0, [stored_event(ha, None, a, unit)]),
        KVEventBatch(2.0, [stored_event(hb, None, b, unit),
                           stored_event([ha[3]], None, a[:4 * unit], 4 * unit, group_idx=None)]),
        KVEventBatch(3.0, [stored_event(ha[:2], None, a[:2 * unit], unit, medium="CPU")]),
        KVEventBatch(4.0, [BlockRemoved(block_hashes=[ha[6]], medium="GPU")]),
    ]
    return a, b, ha, hb, batches


def test_feed_from_events_with_coarse_stores_and_removals():
    unit = 16
    a, b, ha, hb, batches = recorded_stream(unit)
    assert event_unit(batches) == unit
    index = SubseqIndex(unit)
    for batch in batches:
        feed_batch(index, batch)
    request = b[unit:] + a[:unit * 6] + a[unit * 7:]
    m = index.find(request)
    assert m.runs == reference_find(index.units(), request, unit)
    assert [(r.new_start, r.old_start, r.keys) for r in m.runs] == [
        (0, unit, tuple(hb[1:])), (3 * unit, 0, tuple(ha[:6])), (9 * unit, 7 * unit, (ha[7],))]
    # ha[3] is held twice on the GPU (unit and coarse event): one removal keeps it
    feed_batch(index, KVEventBatch(5.0, [BlockRemoved(block_hashes=[ha[3]], medium="GPU")]))
    assert ha[3] in index
    feed_batch(index, KVEventBatch(6.0, [BlockRemoved(block_hashes=[ha[3]], medium="GPU")]))
    assert ha[3] not in index
    # a reset clears the GPU; the CPU tier still holds a's first two units
    feed_batch(index, KVEventBatch(7.0, [AllBlocksCleared()]))
    assert sorted(index.slot_of) == ha[:2]
    assert index.find(a).runs == [Run(0, 0, 2 * unit, tuple(ha[:2]))]
    feed_batch(index, KVEventBatch(8.0, [BlockRemoved(block_hashes=ha[:2], medium=TIER_CPU.medium)]))
    assert len(index) == 0


def test_cli_match_on_a_recording(tmp_path, capsys):
    unit = 16
    a, b, ha, hb, batches = recorded_stream(unit)
    events = tmp_path / "events.jsonl"
    with open(events, "w") as fp:
        recording.write(fp, enumerate(batches))
    prompts = tmp_path / "prompts.jsonl"
    request = b + a[unit:5 * unit]
    prompts.write_text(json.dumps({"token_ids": request}) + "\n" + json.dumps({"token_ids": a}) + "\n")
    assert cli.main(["match", str(events), "--prompts", str(prompts)]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out[0]["prompt_tokens"] == len(request)
    assert out[0]["prefix_tokens"] == 4 * unit
    assert out[0]["reusable_tokens"] == 4 * unit
    assert {"new_start": 4 * unit, "old_start": unit, "length": 4 * unit,
            "keys": ha[1:5]} in out[0]["runs"]
    assert out[1]["prefix_tokens"] == 6 * unit  # a's unit 6 was evicted
    assert out[2]["index"]["units"] == 11
    assert cli.main(["match", str(events), "--prompt", " ".join(map(str, a[:unit]))]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["prefix_tokens"] == unit


def test_units_whose_kv_depends_on_more_than_tokens_are_never_found():
    """Same tokens, but an image, a cache salt (vLLM's extra keys on the first block) or a LoRA
    adapter: their KV differs, so they and every unit after them stay unfindable, yet are
    counted so that removals stay exact."""
    unit = 8
    doc = toks(4 * unit)
    index = SubseqIndex(unit)
    salted = stored_event([1, 2, 3, 4], None, doc, unit, extra_keys=[("salt-a",), None, None, None])
    image = stored_event([11, 12, 13, 14], None, doc, unit, extra_keys=[None, None, (("mm", "img", 0),), None])
    lora = BlockStored(block_hashes=[21, 22], parent_block_hash=None, token_ids=doc[:2 * unit],
                       block_size=unit, lora_id=1, medium="GPU", lora_name="adapter")
    feed_batch(index, KVEventBatch(1.0, [salted, image, lora]))
    m = index.find(doc)
    assert [r.keys for r in m.runs] == [(11, 12)]  # the image's unit and the one after it: never
    lora_index = SubseqIndex(unit)
    feed_batch(lora_index, KVEventBatch(1.0, [salted, lora]), lora_name="adapter")
    assert [r.keys for r in lora_index.find(doc).runs] == [(21, 22)]
    # removals stay exact for excluded units
    feed_batch(index, KVEventBatch(2.0, [BlockRemoved(block_hashes=[1, 2, 3, 4, 13, 14, 21, 22], medium="GPU")]))
    assert index.stats["unknown_removals"] == 0 and not index.excluded and not index.pending
    assert sorted(index.slot_of) == [11, 12]
