"""events.index and events.prompt_hashes: vLLM's prompt hashes without vLLM (kernel vs. plain Python), the n-1 rule, hybrid
checkpoints, tiers, exact removals, resets and gaps, on hand-built event streams."""

import hashlib
import pickle
import random

import cbor2
import numpy as np
import pytest

from vllm_kvbm_plugin.events import prompt_hashes
from vllm_kvbm_plugin.events.index import TIER_GPU, KVIndex, WorkerConfig
from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher, event_extra_keys, unit_extra_keys
from vllm_kvbm_plugin.events.types import (
    TIER_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

rng = random.Random(5)


def toks(n, hi=2000):
    return [rng.randrange(10, hi) for _ in range(n)]


def reference_chain(algo, seed, token_ids, unit, keys=None):
    """vLLM's hash_block_tokens chain, spelled out with pickle / cbor2 and hashlib."""
    dumps = (lambda o: cbor2.dumps(o, canonical=True)) if algo.endswith("cbor") else (
        lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL))
    parent = hashlib.sha256(dumps(seed)).digest()
    out = []
    for u in range(len(token_ids) // unit):
        parent = hashlib.sha256(dumps((parent, tuple(token_ids[u * unit:(u + 1) * unit]),
                                       keys[u] if keys else None))).digest()
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("unit", [4, 16, 23, 24, 32, 160, 300])
def test_kernel_hashes_equal_the_plain_python_chain(algo, unit):
    # every integer width both encodings distinguish: <24, <256, <65536, <2**31
    ids = [rng.choice([rng.randrange(0, 24), rng.randrange(24, 256), rng.randrange(256, 65536),
                       rng.randrange(65536, 2**31)]) for _ in range(unit * 9 + 5)]
    h = PromptHasher(algo, seed="42")
    want = reference_chain(algo, "42", ids, unit)
    assert h.hashes(ids, unit) == want
    assert h.hashes(np.array(ids), unit) == want
    assert h._hashes_python(ids, unit, len(ids) // unit, None) == want
    assert h.event_hashes(ids, unit) == [int.from_bytes(d[-8:], "big") for d in want]
    assert h.event_hashes(ids, unit, as_int=False) == want
    assert h.hashes(ids, unit, n_units=3) == want[:3]


def test_hashlib_fallback_equals_libcrypto_kernel(monkeypatch):
    ids = toks(32 * 20, hi=200000)
    fast = PromptHasher().hashes(ids, 32)
    monkeypatch.setattr(prompt_hashes, "_sha_chain", False)  # as if libcrypto could not be loaded
    assert PromptHasher().hashes(ids, 32) == fast == reference_chain("sha256", "vllm-none-hash", ids, 32)


def test_default_seed_and_unusual_tokens_take_the_general_path():
    assert PromptHasher().none_hash == hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    ids = [5, -1, 2**40, 7] * 8  # outside BININT: pickle's own encoding
    assert PromptHasher().hashes(ids, 4) == reference_chain("sha256", "vllm-none-hash", ids, 4)
    assert PromptHasher().hashes(ids[:6], 3) == reference_chain("sha256", "vllm-none-hash", ids[:6], 3)


def test_extra_keys_like_vllm():
    keys = unit_extra_keys(3, 16, images=[(10, 20, "img0")], lora=("ad", "/p"), cache_salt="s")
    assert keys == [(("lora", "ad", "/p"), ("mm", "img0", 10), ("cache_salt", "s")),
                    (("lora", "ad", "/p"), ("mm", "img0", -6)), (("lora", "ad", "/p"),)]
    assert event_extra_keys(keys[0]) == ("ad", ("img0", 10), "s")
    ids = toks(48)
    assert PromptHasher().hashes(ids, 16, unit_keys=keys) == reference_chain("sha256", "vllm-none-hash", ids, 16, keys)


def test_xxhash_without_seed_cannot_be_computed():
    assert not PromptHasher("xxhash").computable
    with pytest.raises(ValueError, match="unknown prefix caching hash algorithm"):
        PromptHasher("md5")


# ---- streams -------------------------------------------------------------------------------------

H = PromptHasher()


def stored(hashes, tokens, bs, group=0, kind="full_attention", parent=None, medium="GPU", **kw):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=bs, lora_id=None, medium=medium, lora_name=None, group_idx=group,
                       kv_cache_spec_kind=kind, **kw)


def batch(*events, dp=None):
    return KVEventBatch(0.0, list(events), dp)


def served(index, prompt, worker=("w", None), **kw):
    return index.match(prompt, **kw)[worker].tokens


def test_attention_only_longest_chain_capped_at_n_minus_1():
    index = KVIndex()
    p = toks(100)
    hs = H.event_hashes(p, 16)
    index.apply("w", batch(stored(hs, p[:96], 16)), seq=0)
    assert served(index, p) == 96
    assert served(index, p[:96]) == 80  # the last token is always recomputed
    assert served(index, p[:97]) == 96
    assert served(index, p[:10]) == 0
    assert served(index, p[:40] + toks(30)) == 32
    assert served(index, [p[0] + 1] + p[1:]) == 0


def test_hybrid_needs_a_state_checkpoint_at_x():
    """Units up to 288 and checkpoints at 160 (a block end) and 256: a prompt sharing 200 tokens
    is served 160, not the 192 an attention-only index would claim."""
    index = KVIndex()
    p = toks(300)
    hs = H.event_hashes(p, 32)  # 9 units
    index.apply("w", batch(stored(hs, p[:288], 32, group=1),
                           stored([hs[4]], p[:160], 160, group=0, kind="mamba"),
                           stored([hs[7]], p[224:256], 32, group=0, kind="mamba", parent=hs[6])), seq=0)
    assert served(index, p) == 256
    assert served(index, p[:200] + toks(50)) == 160
    assert served(index, p[:257]) == 256 and served(index, p[:256]) == 160
    assert served(index, p[:150]) == 0
    # the attention units are all there, but a state is needed: without any, nothing is served
    index.apply("w", batch(BlockRemoved(block_hashes=[hs[4], hs[7]], medium="GPU", group_idx=0)), seq=1)
    assert served(index, p) == 0


def test_irregular_mamba_events_place_by_hash():
    index = KVIndex()
    p = toks(400)
    hs = H.event_hashes(p, 32)
    index.apply("w", batch(stored(hs[:12], p[:384], 32, group=1),
                           stored([], p[:160], 160, group=0, kind="mamba"),  # no hash at all
                           stored([hs[9]], p[:320], 160, group=0, kind="mamba")), seq=0)  # one hash, 320 tokens
    assert served(index, p) == 320


def test_unit_and_coarse_announce_one_hash_twice_and_removals_are_exact():
    index = KVIndex()
    p = toks(200)
    hs = H.event_hashes(p, 32)
    index.apply("w", batch(stored(hs[:5], p[:160], 32, group=1), stored([hs[4]], p[:160], 160, group=1),
                           stored([hs[4]], p[:160], 160, group=0, kind="mamba")), seq=0)
    assert served(index, p) == 160
    index.apply("w", batch(BlockRemoved(block_hashes=[hs[4]], medium="GPU", group_idx=1)), seq=1)  # coarse
    assert served(index, p) == 160  # still held as a unit
    index.apply("w", batch(BlockRemoved(block_hashes=[hs[4], hs[3]], medium="GPU", group_idx=1)), seq=2)
    assert served(index, p) == 0
    assert index.held("w", group=1) == set(hs[:3])
    index.apply("w", batch(BlockRemoved(block_hashes=[12345], medium="GPU", group_idx=1)), seq=3)
    assert index.stats["unknown_removals"] == 1


def test_reset_clears_gpu_only_and_tiers_follow_the_connector():
    index = KVIndex(WorkerConfig(hash_block_size=16, block_size=16))
    p = toks(100)
    hs = H.event_hashes(p, 16)
    index.apply("w", batch(stored(hs, p[:96], 16), stored(hs[:4], p[:64], 16, medium="CPU")), seq=0)
    m = index.match(p)[("w", None)]
    assert m.tokens == 96 and m.tiers == {TIER_GPU: 96, TIER_CPU: 96}
    index.apply("w", batch(AllBlocksCleared()), seq=1)
    m = index.match(p)[("w", None)]
    assert m.tokens == 64 and m.tiers == {TIER_GPU: 0, TIER_CPU: 64}
    assert index.held("w") == set() and index.held("w", tier=TIER_CPU) == set(hs[:4])
    # GPU holds the first block again: the connector continues from there
    index.apply("w", batch(stored(hs[:1], p[:16], 16)), seq=2)
    assert served(index, p) == 64


def test_tier_blocks_continue_the_gpu_hit_only_from_its_block():
    """KVBMConnector's rule: tier blocks from the GPU hit's block on; a tier run that starts
    later does not count."""
    index = KVIndex(WorkerConfig(hash_block_size=16, block_size=16))
    p = toks(100)
    hs = H.event_hashes(p, 16)
    index.apply("w", batch(stored(hs[:2], p[:32], 16), stored(hs[3:5], p[48:80], 16, medium="CPU", parent=hs[2])), seq=0)
    assert served(index, p) == 32
    index.apply("w", batch(stored(hs[2:3], p[32:48], 16, medium="CPU", parent=hs[1])), seq=1)
    assert served(index, p) == 80


def test_hybrid_tier_state_mid_block():
    index = KVIndex(WorkerConfig(hash_block_size=32, block_size=160))
    p = toks(300)
    hs = H.event_hashes(p, 32)
    index.apply("w", batch(stored(hs[:5], p[:160], 32, group=1), stored([hs[4]], p[:160], 160, group=0, kind="mamba"),
                           stored([hs[4]], p[:160], 160, group=1, medium="CPU"),
                           stored([hs[6]], p[192:224], 32, group=0, kind="mamba", medium="CPU", parent=hs[5])), seq=0)
    m = index.match(p)[("w", None)]
    assert m.tokens == 224 and m.tiers[TIER_GPU] == 160


def test_workers_and_dp_ranks_are_separate():
    index = KVIndex()
    p = toks(100)
    hs = H.event_hashes(p, 16)
    index.apply("a", batch(stored(hs[:2], p[:32], 16), dp=0), seq=0)
    index.apply("a", batch(stored(hs, p[:96], 16), dp=1), seq=1)
    index.apply("b", batch(stored(hs[:4], p[:64], 16)), seq=0)
    got = {k: m.tokens for k, m in index.match(p).items()}
    assert got == {("a", 0): 32, ("a", 1): 96, ("b", None): 64}


def test_gap_marks_stale_until_replayed_in_order():
    index = KVIndex()
    p = toks(100)
    hs = H.event_hashes(p, 16)
    index.apply("w", batch(stored(hs[:2], p[:32], 16)), seq=0)
    index.apply("w", batch(stored(hs[3:4], p[48:64], 16, parent=hs[2]), stored(hs[4:], p[64:96], 16, parent=hs[3])), seq=2)
    m = index.match(p)[("w", None)]
    assert m.stale and m.tokens == 32  # seq 2 waits behind the gap
    index.apply("w", batch(stored(hs[2:3], p[32:48], 16, parent=hs[1]), BlockRemoved(block_hashes=[hs[4]], medium="GPU", group_idx=0)), seq=1)
    m = index.match(p)[("w", None)]
    assert not m.stale and m.tokens == 96  # seq 1 (remove hs[4] before it was stored), then seq 2
    index.apply("w", batch(stored(hs[:1], p[:16], 16)), seq=2)  # a duplicate: ignored
    assert index.held("w") == set(hs)


def test_publisher_restart_resets_the_instance():
    index = KVIndex()
    p = toks(100)
    hs = H.event_hashes(p, 16)
    for s in range(3):
        index.apply("w", batch(stored(hs[s:s + 1], p[16 * s:16 * s + 16], 16)), seq=s)
    index.apply("w", batch(stored(hs[:1], p[:16], 16)), seq=0)
    assert served(index, p) == 16


def test_learned_mode_for_unseeded_xxhash():
    """Hashes the index cannot compute: it learns (parent, tokens, extra keys) -> hash."""
    index = KVIndex(WorkerConfig(hash_algo="xxhash"))
    p = toks(100)
    hs = [rng.getrandbits(64) for _ in range(6)]  # any hashes: the worker's seed is unknown
    index.apply("w", batch(stored(hs[:3], p[:48], 16), stored(hs[3:6], p[48:96], 16, parent=hs[2])), seq=0)
    assert served(index, p) == 96
    assert served(index, p[:40] + toks(40)) == 32
    index.apply("w", batch(BlockRemoved(block_hashes=hs[4:], medium="GPU", group_idx=0)), seq=1)
    assert served(index, p) == 64
    w = index.workers[("w", None)]
    assert len(w.learned) == 4 and hs[5] not in w.learned_key
    # extra keys as events carry them
    index.apply("w", batch(stored([7], p[:16], 16, extra_keys=[["ad"]], parent=None)), seq=2)
    assert index.match(p[:20], lora=("ad", "/x"))[("w", None)].tokens == 16


def test_lora_and_images_change_the_hashes():
    index = KVIndex()
    p = toks(64)
    keys = unit_extra_keys(4, 16, lora=("ad", "/p"))
    hs = H.event_hashes(p, 16, unit_keys=keys)
    index.apply("w", batch(stored(hs, p, 16)), seq=0)
    assert served(index, p) == 0
    assert served(index, p, lora=("ad", "/p")) == 48
    img = unit_extra_keys(4, 16, images=[(0, 8, "cat")])
    hs2 = H.event_hashes(p, 16, unit_keys=img)
    index.apply("v", batch(stored(hs2, p, 16)), seq=0)
    assert served(index, p, worker=("v", None), extra_keys=[k and k for k in img]) == 48
    assert served(index, p, worker=("v", None)) == 0


def test_long_prompts_hash_in_chunks_and_stop_past_an_unheld_block():
    ids = toks(32 * 300, hi=150000)
    assert sum(H.event_hash_chunks(ids, 32, 300), []) == H.event_hashes(ids, 32)
    index = KVIndex(WorkerConfig(hash_block_size=32, block_size=160))
    hs = H.event_hashes(ids, 32)
    index.apply("w", batch(stored(hs[:100], ids[:3200], 32, group=1),
                           stored([hs[99]], ids[3168:3200], 32, group=0, kind="mamba", parent=hs[98]),
                           stored(hs[250:], ids[8000:], 32, group=1, parent=hs[249])), seq=0)
    assert served(index, ids) == 3200
    assert served(index, ids[:3200]) == 0  # the checkpoint at 3200 is the last token: n - 1 rule
    hashed = []

    def counted(chunks):
        for c in chunks:
            hashed.append(len(c))
            yield c

    masks = index._masks_chunks(counted(H.event_hash_chunks(ids, 32, 299)), 299, 5)
    assert 105 <= sum(hashed) <= 192  # stopped in the chunk after the first unheld block
    assert masks[:100].all() and not masks[100:].any()


@pytest.mark.parametrize("tier_first", [False, True])
def test_bare_tier_hashes_take_their_groups_kind_from_gpu_events(tier_first):
    """vLLM 0.32's offloading placeholders (a hash, block size 0, no kind) for a Mamba group's
    state, before or after the group's GPU events: a state checkpoint, not an attention block."""
    index = KVIndex(WorkerConfig(hash_block_size=32, block_size=160))
    p = toks(400)
    hs = H.event_hashes(p, 32)
    tier = batch(stored(hs[:10], p[:320], 32, group=1, medium="CPU"),
                 stored([hs[9]], [], 0, group=0, kind=None, medium="CPU"))
    gpu = batch(stored([toks(1)[0]], toks(32), 32, group=1), stored([toks(1)[0]], toks(160), 160, group=0, kind="mamba"))
    for seq, b in enumerate([tier, gpu] if tier_first else [gpu, tier]):
        index.apply("w", b, seq=seq)
    m = index.match(p)[("w", None)]
    assert m.tokens == 320 and m.tiers[TIER_CPU] == 320
    # the same state without it: no checkpoint, no tier hit (a hybrid needs the state)
    index.apply("w", batch(BlockRemoved(block_hashes=[hs[9]], medium="CPU", group_idx=0)), seq=2)
    assert index.match(p)[("w", None)].tokens == 0


@pytest.mark.parametrize("medium", ["CPU", "STORAGE"])
def test_offloading_connector_takes_a_partial_tail_state_from_the_cpu_tier_only(medium):
    """Whole blocks and their states in a tier, and a state 32 tokens into the next block: vLLM's
    OffloadingConnector serves that partial tail from the CPU tier, not from a STORAGE tier
    (KVBMConnector from either)."""
    p = toks(400)
    hs = H.event_hashes(p, 32)
    where = {"medium": medium, **({"locality": "LOCAL", "ownership": "kvbm-disk:x"} if medium == "STORAGE" else {})}
    tier = batch(stored(hs[:11], p[:352], 32, group=1, **where), stored([hs[9]], [], 0, group=0, kind="mamba", **where),
                 stored([hs[10]], [], 0, group=0, kind="mamba", **where))
    got = {}
    for connector in ("KVBMConnector", "OffloadingConnector"):
        index = KVIndex(WorkerConfig(hash_block_size=32, block_size=160, connector=connector))
        index.apply("w", tier, seq=0)
        got[connector] = served(index, p)
    assert got == {"KVBMConnector": 352, "OffloadingConnector": 352 if medium == "CPU" else 320}
    with pytest.raises(ValueError, match="valid: KVBMConnector, OffloadingConnector"):
        WorkerConfig(connector="LMCache")


# ---- a shared REMOTE tier ------------------------------------------------------------------------

REMOTE = {"medium": "STORAGE", "locality": "REMOTE", "ownership": "kvbm-remote:ab"}


def test_a_remote_block_stored_by_one_instance_is_a_hit_for_another():
    """A's remote stores serve B, which never announced anything, once the index knows B reads
    that store: from B's own remote announcements, or from its config ("all"). A removal from
    either stream, or the announcer's flush, takes the block away for both; A's restart does not."""
    p, other = toks(200), toks(200)
    hs = H.event_hashes(p, 16)
    index = KVIndex(WorkerConfig(hash_block_size=16, block_size=16))
    index.add_instance("B", ranks=(0,))
    index.add_instance("C", WorkerConfig(hash_block_size=16, block_size=16, remote="all"), ranks=(0,))
    index.add_instance("D", WorkerConfig(remote="none"), ranks=(0,))
    index.apply("A", batch(stored(hs[:8], p[:128], 16), stored(hs[:8], p[:128], 16, **REMOTE), dp=0), seq=0)
    got = index.match(p)
    assert got[("A", 0)].tokens == 128
    assert got[("C", 0)].tokens == 128 and got[("C", 0)].tiers[TIER_GPU] == 0  # from the shared store alone
    assert got[("B", 0)].tokens == 0  # not known to read that store yet
    assert got[("D", 0)].tokens == 0
    # B writes one block of another prompt there: now it reads the store
    ohs = H.event_hashes(other, 16)
    index.apply("B", batch(stored(ohs[:1], other[:16], 16, **REMOTE), dp=0), seq=0)
    assert index.match(p)[("B", 0)].tokens == 128
    # A restarts (its stream from seq 0 again): its GPU blocks are gone, the store's are not
    index.apply("A", batch(stored(ohs[:1], other[:16], 16), dp=0), seq=1)
    index.apply("A", batch(dp=0), seq=0)
    got = index.match(p)
    assert got[("A", 0)].tokens == 128 and got[("A", 0)].tiers[TIER_GPU] == 0
    assert got[("B", 0)].tokens == 128 and got[("C", 0)].tokens == 128
    # B finds block 5 gone: a miss from block 5 on, for every reader
    index.apply("B", batch(BlockRemoved(block_hashes=[hs[4]], group_idx=0, **REMOTE), dp=0), seq=1)
    assert index.match(p)[("C", 0)].tokens == 64 == index.match(p)[("B", 0)].tokens
    # the remote tier's announcer (a stream with remote tiers only) announces a flush
    index.apply("announcer", batch(stored(ohs[1:2], other[16:32], 16, parent=ohs[0], **REMOTE)), seq=0)
    index.apply("announcer", batch(AllBlocksCleared()), seq=1)
    assert index.match(p)[("C", 0)].tokens == 0
    assert index.match(other)[("C", 0)].tokens == 0


def test_remote_tiers_are_told_apart_by_ownership():
    p = toks(100)
    hs = H.event_hashes(p, 16)
    index = KVIndex(WorkerConfig(hash_block_size=16, block_size=16))
    index.apply("A", batch(stored(hs[:4], p[:64], 16, **REMOTE)), seq=0)
    index.apply("B", batch(stored([toks(1)[0]], toks(16), 16, **{**REMOTE, "ownership": "kvbm-remote:cd"})), seq=0)
    assert index.match(p)[("B", None)].tokens == 0  # B reads another store (another layout)
    assert index.match(p)[("A", None)].tokens == 64


def test_a_new_hybrid_instance_takes_states_from_the_shared_tier():
    """A hybrid's attention blocks and state checkpoint stored remotely by A: B, which announced
    nothing, is taken for hybrid (its shared tier holds states) and served up to the checkpoint,
    not to the last attention block; under vLLM's OffloadingConnector a state inside a block is
    not taken from a STORAGE tier."""
    p = toks(400)
    hs = H.event_hashes(p, 32)
    for connector, want in (("KVBMConnector", 352), ("OffloadingConnector", 320)):
        cfg = WorkerConfig(hash_block_size=32, block_size=160, connector=connector, remote="all")
        index = KVIndex(cfg)
        index.add_instance("B", cfg, ranks=(0,))
        index.apply("A", batch(stored(hs[:12], p[:384], 32, group=1, **REMOTE),
                               stored([hs[9]], [], 0, group=0, kind="mamba", **REMOTE),
                               stored([hs[10]], [], 0, group=0, kind="mamba", **REMOTE), dp=0), seq=0)
        assert index.match(p)[("B", 0)].tokens == want, connector
    with pytest.raises(ValueError, match="valid: announced, all, none"):
        WorkerConfig(remote="some")
