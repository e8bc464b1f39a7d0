import random

import numpy as np
import pytest

from vllm_kvbm_plugin.hashing import request_keys, spec

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
