import ast
import random
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest

from vllm_kvbm_plugin.hashing import Keyer, kernels, spec

SECRET = bytes(range(16))  # the doc's test secret (the SipHash paper's test key)
KEYER = Keyer(SECRET)
ROOT = spec.root_key(SECRET, "tiny-llama", "bfloat16", "LBHNC", 32, 0, 1)
K0, K1 = (np.uint64(w) for w in spec.secret_words(SECRET))


def hx(k):
    return f"{int(k[0]):016x}{int(k[1]):016x}"


def le(k):
    """The 16 output bytes of SipHash-128 as the reference code writes them."""
    return int(k[0]).to_bytes(8, "little") + int(k[1]).to_bytes(8, "little")


# Published SipHash-2-4 vectors: key 00..0f, message 00 01 .. (n-1). 128-bit output: the reference
# implementation's vectors_sip128[n]; 64-bit output: vectors_sip64[0] and the paper's appendix (n = 15).
SIP128 = {0: "a3817f04ba25a8e66df67214c7550293", 1: "da87c1d86b99af44347659119b22fc45",
          7: "a1f1ebbed8dbc153c0b84aa61ff08239", 8: "3b62a9ba6258f5610f83e264f31497b4",
          15: "5493e99933b0a8117e08ec0f97cfc3d9", 16: "6ee2a4ca67b054bbfd3315bf85230577",
          63: "5150d1772f50834a503e069a973fbd7c"}
SIP64 = {0: 0x726FDB47DD0E0E31, 15: 0xA129CA6149BE45E5}


def test_siphash_2_4_matches_the_published_vectors():
    for n, want in SIP128.items():
        msg = bytes(range(n))
        assert le(spec.siphash(SECRET, msg, 2, 4)).hex() == want, n
        assert le(kernels.siphash(msg, K0, K1, 2, 4, True)).hex() == want, n
    for n, want in SIP64.items():
        msg = bytes(range(n))
        assert spec.siphash(SECRET, msg, 2, 4, wide=False) == want
        assert int(kernels.siphash(msg, K0, K1, 2, 4, False)[0]) == want
    # the block keys are exactly SipHash-2-4-128 of tagged messages (so the vectors cover them)
    assert (spec.C_ROUNDS, spec.D_ROUNDS) == (kernels._C, kernels._D) == (2, 4)
    assert spec.token_hash(SECRET, [1, -2]) == spec.siphash(
        SECRET, b"kvbm:tok" + (1).to_bytes(8, "little") + (2**64 - 2).to_bytes(8, "little"))


def test_golden_vectors_from_the_spec():
    assert hx(ROOT) == "802ffb4f05d88c0ea7a75f298650a493"
    assert hx(spec.token_hash(SECRET, list(range(32)))) == "db3481f8bc9ed44f5295034b11b6cab0"
    assert hx(spec.extra_hash(SECRET, (("mm", "img-a", 5),))) == "babd640ae121310af337fa7e9cc32325"
    assert [hx(k) for k in spec.unit_keys(SECRET, list(range(64)), 32, ROOT)] == [
        "12be46e7d297c79c8a978fe61d9b97a2", "2b88c88293553f3baf4bd3cb3c246960"]
    img = [spec.NO_EXTRA, spec.extra_hash(SECRET, (("mm", "img-a", -3),))]
    assert [hx(k) for k in spec.unit_keys(SECRET, list(range(64)), 32, ROOT, img)] == [
        "12be46e7d297c79c8a978fe61d9b97a2", "4c0c857062fd70de967563875524e148"]
    assert KEYER.root("tiny-llama", "bfloat16", "LBHNC", 32, 0, 1) == ROOT and "00" not in repr(KEYER)


def test_spec_1_golden_vectors_still_name_its_directories():
    assert spec.mix64(1) == 0x5692161D100B05E5
    v1_root = spec.v1_root_key("tiny-llama", "bfloat16", "LBHNC", 32, 0, 1)
    assert hx(v1_root) == "9ada9426e4d460d5fdc69220fcd8219b"
    assert hx(spec.v1_token_hash(list(range(32)))) == "aab024964afe540fd586630381bcb006"
    assert hx(spec.v1_extra_hash((("mm", "img-a", 5),))) == "ff0d488de234a140c3e2ad689a768c19"
    assert [hx(k) for k in spec.v1_unit_keys(list(range(64)), 32, v1_root)] == [
        "69592461d5373bc7989518c42b8824b8", "981ee750cda0583e99da35d553b243da"]
    img = [spec.NO_EXTRA, spec.v1_extra_hash((("mm", "img-a", -3),))]
    assert [hx(k) for k in spec.v1_unit_keys(list(range(64)), 32, v1_root, img)] == [
        "69592461d5373bc7989518c42b8824b8", "ceaf2b1b29eb84a57d0fd3429bf00ee2"]


@pytest.mark.parametrize("unit", [1, 3, 16, 32, 64])
def test_numba_kernel_is_bit_exact_with_the_reference(unit):
    rng = random.Random(unit)
    for _ in range(5):
        tokens = [rng.randrange(0, 2**31) for _ in range(rng.randrange(0, 20 * unit + 7))]
        if tokens:
            tokens[0] = -rng.randrange(1, 2**40)  # ids are 64-bit words, negative ones included
        n = len(tokens) // unit
        extras = {i: spec.extra_hash(SECRET, (("mm", f"img{i}", rng.randrange(-99, 99)),))
                  for i in range(n) if rng.random() < 0.3}
        ref = spec.unit_keys(SECRET, tokens, unit, ROOT, [extras.get(i, spec.NO_EXTRA) for i in range(n)])
        got = KEYER.request_keys(tokens, unit, ROOT, extras)
        assert got.dtype == np.uint64 and got.shape == (n, 2)
        assert [tuple(map(int, k)) for k in got] == ref
        arr = np.asarray(tokens, np.int64)
        assert [tuple(map(int, k)) for k in KEYER.request_keys(arr, unit, ROOT, extras)] == ref


def test_keys_separate_what_must_not_share_kv():
    toks = list(range(96))
    base = KEYER.request_keys(toks, 32, ROOT)
    # another model, dtype, layout or tensor-parallel shard: nothing in common
    for other in (KEYER.root("other", "bfloat16", "LBHNC", 32), KEYER.root("tiny-llama", "float16", "LBHNC", 32),
                  KEYER.root("tiny-llama", "bfloat16", "NHD", 32), KEYER.root("tiny-llama", "bfloat16", "LBHNC", 32, 1, 2)):
        assert not set(map(tuple, KEYER.request_keys(toks, 32, other).tolist())) & set(map(tuple, base.tolist()))
    # an image in unit 1 changes unit 1 and everything after it, not unit 0
    img = KEYER.request_keys(toks, 32, ROOT, {1: KEYER.extra_hash((("mm", "x", 0),))})
    assert (img[0] == base[0]).all() and not (img[1] == base[1]).any() and not (img[2] == base[2]).any()
    # a shared prefix shares keys; one changed token changes its unit and the rest
    assert (KEYER.request_keys(toks[:64], 32, ROOT) == base[:2]).all()
    changed = KEYER.request_keys(toks[:40] + [7] + toks[41:], 32, ROOT)
    assert (changed[0] == base[0]).all() and not (changed[1:] == base[1:]).all(axis=1).any()
    # chaining from a unit's key continues the same chain (how the scheduler extends a request)
    assert (KEYER.request_keys(toks[32:], 32, tuple(map(int, base[0]))) == base[1:]).all()


DOC = Path(__file__).resolve().parents[2] / "docs" / "block-keys.md"
IMAGE_PAD = 151655
DOC_IMAGES = [("img-a", 20, 24), ("img-b", 64, 40)]  # identifier, offset, length (the doc's inputs)
_ROW = re.compile(r"^(\d+)\s+(\d+)\.\.(\d+)\s+(\(.*\)|None)\s+([0-9a-f]{16}) ([0-9a-f]{16})\s+"
                  r"([0-9a-f]{16}) ([0-9a-f]{16})$")


def _doc_image_vectors():
    """(units, msgpack bytes) of the doc's 'Golden vectors: image folding' section."""
    section = DOC.read_text().split("## Golden vectors: image folding", 1)[1].split("\n## ", 1)[0]
    units, packed = [], {}
    for line in section.splitlines():
        m = _ROW.match(line.strip())
        if m:
            i, lo, hi, keys, ea, eb, ka, kb = m.groups()
            units.append((int(i), int(lo), int(hi), ast.literal_eval(keys), ea + eb, ka + kb))
        m = re.match(r"^msgpack\(extra_keys_(\d+)\) = ([0-9a-f ]+)$", line.strip())
        if m:
            packed[int(m.group(1))] = bytes.fromhex(m.group(2))
    return units, packed


def test_image_folding_golden_vectors_match_the_doc_and_vllm():
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request

    from vllm_kvbm_plugin import compat

    units, packed = _doc_image_vectors()
    assert [u[0] for u in units] == list(range(5)) and sorted(packed) == list(range(4))
    tokens = list(range(160))
    for _, off, n in DOC_IMAGES:
        tokens[off : off + n] = [IMAGE_PAD] * n
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident, mm_hash=ident,
                                      mm_position=PlaceholderRange(offset=off, length=n))
                for ident, off, n in DOC_IMAGES]
    request = Request("golden", tokens, SamplingParams(max_tokens=1), None, mm_features=features)
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=32)

    extras, mm = {}, 0
    for i, lo, hi, doc_keys, doc_e, _ in units:
        assert (lo, hi) == (32 * i, 32 * i + 31)
        keys, mm = compat.block_extra_keys(pool, request, lo, hi + 1, mm)  # like SchedulerSide._block_keys
        assert keys == doc_keys
        if keys:
            assert msgspec.msgpack.encode(keys) == packed[i]
        e = spec.extra_hash(SECRET, keys)
        assert hx(e) == doc_e and hx(KEYER.extra_hash(keys)) == doc_e  # reference and numba
        if keys:
            extras[i] = e
    doc_k = [u[5] for u in units]
    ref = spec.unit_keys(SECRET, tokens, 32, ROOT, [extras.get(i, spec.NO_EXTRA) for i in range(len(units))])
    assert [hx(k) for k in ref] == doc_k
    assert [hx(k) for k in KEYER.request_keys(tokens, 32, ROOT, extras)] == doc_k


def test_numba_extra_hash_is_bit_exact_with_the_reference():
    rng = random.Random(7)
    for n in [*range(0, 41), 72, 255, 256, 1000]:
        data = bytes(rng.randrange(256) for _ in range(n))
        for c, d in ((2, 4), (1, 3)):
            assert tuple(map(int, kernels.siphash(data, K0, K1, c, d, True))) == spec.siphash(SECRET, data, c, d)
            assert tuple(map(int, kernels.siphash(np.frombuffer(data, dtype=np.uint8), K0, K1, c, d, True))) == \
                spec.siphash(SECRET, data, c, d)
        assert tuple(map(int, kernels.extra_hash(data, K0, K1))) == spec.siphash(SECRET, b"kvbm:ext" + data)
    cases = [None, (), (("mm", "img-a", 5),), (("mm", "a" * 64, -300), ("mm", "b" * 64, 17)),
             (("lora", "adapter", "/path/to/adapter"), ("mm", "img", 0), ("cache_salt", "s")),
             (("prompt_embeds", bytes(range(32))),), (("mm", "img", 2**40),)]
    for keys in cases:
        got = KEYER.extra_hash(keys)
        assert got == spec.extra_hash(SECRET, keys) and all(type(x) is int for x in got)
