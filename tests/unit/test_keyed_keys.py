"""Why the block keys are keyed (issue 11, item 4): spec 1's token hash could be inverted by anyone,
and its salted chains inherited every token-hash collision; spec 2's keys are SipHash under the tier
secret, so the same inputs give different keys and other secrets give unrelated ones."""

import os
import random

from vllm_kvbm_plugin.hashing import Keyer, spec

M64 = (1 << 64) - 1


def _lanes_after(words):
    """Spec 1's two lane states after absorbing `words` (before the length is mixed in)."""
    a, b = spec.V1_TOKEN_SEEDS
    for w in words:
        a = spec.mix64(((a ^ w) + spec.GOLDEN) & M64)
        b = spec.mix64(((b ^ w) + spec.GOLDEN) & M64)
    return a, b


def v1_token_collision(unit: list[int]) -> list[int]:
    """Another unit with spec 1's token hash of `unit`, without any search: xoring the first word
    with the xor of the two lane seeds swaps the lanes (each lane absorbs `seed ^ word`); then xoring
    the second word with the xor of the lane states merges them again. The rest is unchanged."""
    a, b = _lanes_after(unit[:1])
    first = unit[0] ^ spec.V1_TOKEN_SEEDS[0] ^ spec.V1_TOKEN_SEEDS[1]
    return [first, unit[1] ^ a ^ b, *unit[2:]]


def _as_int64(words):
    return [w - (1 << 64) if w >= 1 << 63 else w for w in words]  # the same 64-bit words as token ids


def test_spec_1_salted_chains_collide_when_the_token_hash_does_and_spec_2_keys_do_not():
    rng = random.Random(11)
    unit = [rng.randrange(150000) for _ in range(32)]
    forged = _as_int64(v1_token_collision(unit))
    assert forged != unit and spec.v1_token_hash(forged) == spec.v1_token_hash(unit)

    # the same prefix continues both prompts; the forged unit sits in the middle of the prompt
    head, tail = [rng.randrange(150000) for _ in range(32)], [rng.randrange(150000) for _ in range(64)]
    honest, attack = head + unit + tail, head + forged + tail
    # spec 1: whatever the salt (a deployment secret in the root), the chains are equal from the
    # forged unit on: a request for `attack` would be served the KV of `honest`
    for salt in ("", "tenant-a", os.urandom(16).hex()):
        root = spec.v1_root_key("llama", "bfloat16", "LBHNC", 32, 0, 1, salt)
        assert spec.v1_unit_keys(honest, 32, root) == spec.v1_unit_keys(attack, 32, root)

    # spec 2: keyed by the secret at every stage, the token hash and every key from that unit on differ
    for secret in (bytes(range(16)), os.urandom(16)):
        k = Keyer(secret)
        root = k.root("llama", "bfloat16", "LBHNC", 32)
        assert spec.token_hash(secret, unit) != spec.token_hash(secret, forged)
        h, f = k.request_keys(honest, 32, root), k.request_keys(attack, 32, root)
        assert (h[0] == f[0]).all()  # the shared head
        assert not (h[1:] == f[1:]).any(axis=1).any()  # no key half in common after it
        assert [tuple(map(int, x)) for x in f] == spec.unit_keys(secret, attack, 32, root)  # kernel = reference


def _bits(keys) -> int:
    return sum(bin(int(x)).count("1") for x in keys.reshape(-1))


def test_keys_under_another_secret_are_unrelated():
    """Nothing an outsider computes without the secret predicts a key: other secrets (all zeros, the
    public test key, random ones, the secret with one bit flipped) give other roots and keys that share
    no key, and differ from the real ones in about half their bits."""
    rng = random.Random(5)
    tokens = [rng.randrange(150000) for _ in range(32 * 64)]
    secret = os.urandom(16)
    flipped = bytes([secret[0] ^ 1]) + secret[1:]
    ours = Keyer(secret)
    root = ours.root("llama", "bfloat16", "LBHNC", 32)
    keys = ours.request_keys(tokens, 32, root)
    seen = set(map(tuple, keys.tolist()))
    for other_secret in (bytes(16), bytes(range(16)), os.urandom(16), flipped):
        other = Keyer(other_secret)
        other_root = other.root("llama", "bfloat16", "LBHNC", 32)
        assert other_root != root
        for r in (other_root, root):  # even chained from our (visible) root, without our secret
            theirs = other.request_keys(tokens, 32, r)
            assert not seen & set(map(tuple, theirs.tolist()))
            differing = _bits(keys ^ theirs)
            assert 0.45 < differing / (keys.size * 64) < 0.55, differing
    # and the extra-key hash is keyed too
    assert ours.extra_hash((("mm", "img", 0),)) != Keyer(flipped).extra_hash((("mm", "img", 0),))
