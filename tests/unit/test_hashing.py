import ast
import random
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest

from vllm_kvbm_plugin.hashing import extra_hash, kernels, request_keys, spec

ROOT = spec.root_key("tiny-llama", "bfloat16", "LBHNC", 32, 0, 1)


def hx(k):
    return f"{int(k[0]):016x}{int(k[1]):016x}"


def test_golden_vectors_from_the_spec():
    assert spec.mix64(1) == 0x5692161D100B05E5
    assert hx(ROOT) == "9ada9426e4d460d5fdc69220fcd8219b"
    assert hx(spec.token_hash(list(range(32)))) == "aab024964afe540fd586630381bcb006"
    assert hx(spec.extra_hash((("mm", "img-a", 5),))) == "ff0d488de234a140c3e2ad689a768c19"
    assert [hx(k) for k in spec.unit_keys(list(range(64)), 32, ROOT)] == [
        "69592461d5373bc7989518c42b8824b8", "981ee750cda0583e99da35d553b243da"]
    img = [spec.NO_EXTRA, spec.extra_hash((("mm", "img-a", -3),))]
    assert [hx(k) for k in spec.unit_keys(list(range(64)), 32, ROOT, img)] == [
        "69592461d5373bc7989518c42b8824b8", "ceaf2b1b29eb84a57d0fd3429bf00ee2"]


@pytest.mark.parametrize("unit", [1, 16, 32, 64])
def test_numba_kernel_is_bit_exact_with_the_reference(unit):
    rng = random.Random(unit)
    for _ in range(5):
        tokens = [rng.randrange(0, 2**31) for _ in range(rng.randrange(0, 20 * unit + 7))]
        n = len(tokens) // unit
        extras = {i: spec.extra_hash((("mm", f"img{i}", rng.randrange(-99, 99)),))
                  for i in range(n) if rng.random() < 0.3}
        ref = spec.unit_keys(tokens, unit, ROOT, [extras.get(i, spec.NO_EXTRA) for i in range(n)])
        got = request_keys(tokens, unit, ROOT, extras)
        assert got.dtype == np.uint64 and got.shape == (n, 2)
        assert [tuple(map(int, k)) for k in got] == ref


def test_keys_separate_what_must_not_share_kv():
    toks = list(range(96))
    base = request_keys(toks, 32, ROOT)
    # another model, dtype, layout or tensor-parallel shard: nothing in common
    for other in (spec.root_key("other", "bfloat16", "LBHNC", 32), spec.root_key("tiny-llama", "float16", "LBHNC", 32),
                  spec.root_key("tiny-llama", "bfloat16", "NHD", 32), spec.root_key("tiny-llama", "bfloat16", "LBHNC", 32, 1, 2)):
        assert not set(map(tuple, request_keys(toks, 32, other).tolist())) & set(map(tuple, base.tolist()))
    # an image in unit 1 changes unit 1 and everything after it, not unit 0
    img = request_keys(toks, 32, ROOT, {1: spec.extra_hash((("mm", "x", 0),))})
    assert (img[0] == base[0]).all() and not (img[1] == base[1]).any() and not (img[2] == base[2]).any()
    # a shared prefix shares keys; one changed token changes its unit and the rest
    assert (request_keys(toks[:64], 32, ROOT) == base[:2]).all()
    changed = request_keys(toks[:40] + [7] + toks[41:], 32, ROOT)
    assert (changed[0] == base[0]).all() and not (changed[1:] == base[1:]).all(axis=1).any()


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
        e = spec.extra_hash(keys)
        assert hx(e) == doc_e and hx(extra_hash(keys)) == doc_e  # reference and numba
        if keys:
            extras[i] = e
    doc_k = [u[5] for u in units]
    ref = spec.unit_keys(tokens, 32, ROOT, [extras.get(i, spec.NO_EXTRA) for i in range(len(units))])
    assert [hx(k) for k in ref] == doc_k
    assert [hx(k) for k in request_keys(tokens, 32, ROOT, extras)] == doc_k


def test_numba_extra_hash_is_bit_exact_with_the_reference():
    rng = random.Random(7)
    for n in [*range(0, 41), 72, 255, 1000]:
        data = bytes(rng.randrange(256) for _ in range(n))
        assert tuple(kernels.bytes_hash(data)) == spec.hash_bytes(data)
        assert tuple(kernels.bytes_hash(np.frombuffer(data, dtype=np.uint8))) == spec.hash_bytes(data)
    cases = [None, (), (("mm", "img-a", 5),), (("mm", "a" * 64, -300), ("mm", "b" * 64, 17)),
             (("lora", "adapter", "/path/to/adapter"), ("mm", "img", 0), ("cache_salt", "s")),
             (("prompt_embeds", bytes(range(32))),), (("mm", "img", 2**40),)]
    for keys in cases:
        got = extra_hash(keys)
        assert got == spec.extra_hash(keys) and all(type(x) is int for x in got)
