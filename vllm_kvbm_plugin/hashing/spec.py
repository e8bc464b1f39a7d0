"""Two-stage keyed block keys: the plain-Python reference of docs/block-keys.md (spec version 2).

Stage 1 hashes each hash unit on its own: a token hash over its token ids and an extra hash over
its extra keys (image identifiers with offsets, LoRA name, cache salt, prompt-embed digests).
Stage 2 chains them: key_i = H(key_{i-1}, token_hash_i, extra_hash_i), with key_{-1} = a root
naming everything that makes KV bytes differ (model, dtype, KV layout, unit size, tensor-parallel
rank and size). Every stage is SipHash-2-4 with 128-bit output keyed by the tier's 128-bit secret
(tiers/secret.py), each stage's messages starting with their own 8-byte tag: without the secret,
nobody can compute a key or choose token ids that make two keys collide. Keys are 128-bit (two
64-bit halves), independent of PYTHONHASHSEED and of vLLM's hash algorithm. The numba kernel in
`kernels.py` must match this module bit for bit (tested).

The retired spec 1 (an unkeyed splitmix construction) is kept at the end: the connector computes
its tier directory name to remove what spec 1 left on disk, and the tests show why it was retired.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import msgspec

SPEC_VERSION = 2
M64 = (1 << 64) - 1
SECRET_BYTES = 16

Key = tuple[int, int]
NO_EXTRA: Key = (0, 0)

# ---- SipHash (Aumasson and Bernstein, "SipHash: a fast short-input PRF", 2012) --------------
C_ROUNDS, D_ROUNDS = 2, 4  # compression and finalization rounds: the paper's SipHash-2-4
_INIT = (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def _sipround(v0: int, v1: int, v2: int, v3: int) -> tuple[int, int, int, int]:
    v0 = (v0 + v1) & M64
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 = (v2 + v3) & M64
    v3 = _rotl(v3, 16) ^ v2
    v0 = (v0 + v3) & M64
    v3 = _rotl(v3, 21) ^ v0
    v2 = (v2 + v1) & M64
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def secret_words(secret: bytes) -> tuple[int, int]:
    """SipHash's key words k0, k1: the secret's two little-endian 64-bit halves."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a block-key secret is {SECRET_BYTES} bytes, got {len(secret)}")
    return int.from_bytes(secret[:8], "little"), int.from_bytes(secret[8:], "little")


@overload
def siphash(secret: bytes, data: bytes, c: int = ..., d: int = ..., wide: Literal[True] = ...) -> Key: ...
@overload
def siphash(secret: bytes, data: bytes, c: int, d: int, wide: Literal[False]) -> int: ...
@overload
def siphash(secret: bytes, data: bytes, c: int = ..., d: int = ..., *, wide: Literal[False]) -> int: ...


def siphash(secret: bytes, data: bytes, c: int = C_ROUNDS, d: int = D_ROUNDS, wide: bool = True) -> Key | int:
    """SipHash-c-d of `data` under the 16-byte key `secret`: with `wide`, the 128-bit output as
    (first 64-bit half, second half), else the 64-bit output. With c=2, d=4 this is the paper's
    SipHash-2-4 (tested against the published vectors)."""
    k0, k1 = secret_words(secret)
    v0, v1, v2, v3 = k0 ^ _INIT[0], k1 ^ _INIT[1], k0 ^ _INIT[2], k1 ^ _INIT[3]
    if wide:
        v1 ^= 0xEE
    n = len(data)
    tail = data[n - n % 8:] + b"\0" * (7 - n % 8) + bytes([n & 0xFF])
    for i in range(0, n - n % 8 + 8, 8):
        m = int.from_bytes(data[i:i + 8] if i + 8 <= n else tail, "little")
        v3 ^= m
        for _ in range(c):
            v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0 ^= m
    v2 ^= 0xEE if wide else 0xFF
    for _ in range(d):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    first = v0 ^ v1 ^ v2 ^ v3
    if not wide:
        return first
    v1 ^= 0xDD
    for _ in range(d):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    return first, v0 ^ v1 ^ v2 ^ v3


# ---- block keys ------------------------------------------------------------------------------
# Each stage's messages start with its own tag (8 ASCII bytes), so no two stages hash equal bytes.
TOKEN_TAG, EXTRA_TAG, CHAIN_TAG, ROOT_TAG = b"kvbm:tok", b"kvbm:ext", b"kvbm:chn", b"kvbm:rot"


def words_bytes(words: Sequence[int]) -> bytes:
    """Little-endian 64-bit words (negative ints as two's complement)."""
    return b"".join((w & M64).to_bytes(8, "little") for w in words)


def token_hash(secret: bytes, tokens: Sequence[int]) -> Key:
    return siphash(secret, TOKEN_TAG + words_bytes(tokens))


def extra_hash(secret: bytes, extra_keys: tuple | None) -> Key:
    """Hash of one unit's extra keys, in vLLM's tagged form, e.g. (("mm", "<id>", 5),).

    Canonical bytes are msgpack of the tuple (tuples as arrays; str, int and bytes as themselves).
    A unit without extra keys hashes to (0, 0), so text-only units cost nothing here.
    """
    if not extra_keys:
        return NO_EXTRA
    return siphash(secret, EXTRA_TAG + msgspec.msgpack.encode(extra_keys))


def chain(secret: bytes, parent: Key, tokens: Key, extra: Key) -> Key:
    return siphash(secret, CHAIN_TAG + words_bytes((*parent, *tokens, *extra)))


def root_key(secret: bytes, model: str, dtype: str, kv_layout: str, unit: int, tp_rank: int = 0,
             tp_size: int = 1) -> Key:
    """The root every request's chain starts from: keyed too, so it names a tier directory (and a
    remote key prefix) that changes with the secret and the spec version."""
    fingerprint = ["vllm-kvbm-block-key", SPEC_VERSION, model, dtype, kv_layout, unit, tp_rank, tp_size]
    return siphash(secret, ROOT_TAG + msgspec.msgpack.encode(fingerprint))


def unit_keys(secret: bytes, tokens: Sequence[int], unit: int, root: Key,
              extras: Sequence[Key] | None = None) -> list[Key]:
    """Keys of every full `unit`-token unit of `tokens` (extras: one extra hash per unit)."""
    keys, parent = [], root
    for i in range(len(tokens) // unit):
        extra = extras[i] if extras is not None else NO_EXTRA
        parent = chain(secret, parent, token_hash(secret, tokens[i * unit: (i + 1) * unit]), extra)
        keys.append(parent)
    return keys


# ---- spec 1 (retired: unkeyed) ---------------------------------------------------------------
# Kept for v1_root_key (the name of the tier directory spec 1 wrote, removed at startup) and for
# the test that shows its weakness: every lane is a chain of bijections an outsider can invert, so
# token ids can be chosen to collide in the token hash, and then in every salted chain.
GOLDEN = 0x9E3779B97F4A7C15
V1_TOKEN_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)
V1_CHAIN_SEEDS = (0xA4093822299F31D0, 0x082EFA98EC4E6C89)
V1_BYTES_SEEDS = (0x452821E638D01377, 0xBE5466CF34E90C6C)


def mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit words with full avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def v1_lane(seed: int, words: Sequence[int]) -> int:
    h = seed
    for w in words:
        h = mix64(((h ^ (w & M64)) + GOLDEN) & M64)
    return mix64(h ^ len(words))


def v1_hash128(seeds: tuple[int, int], words: Sequence[int]) -> Key:
    return v1_lane(seeds[0], words), v1_lane(seeds[1], words)


def v1_bytes_words(data: bytes) -> list[int]:
    padded = data + b"\0" * (-len(data) % 8)
    return [int.from_bytes(padded[i: i + 8], "little") for i in range(0, len(padded), 8)] + [len(data)]


def v1_token_hash(tokens: Sequence[int]) -> Key:
    return v1_hash128(V1_TOKEN_SEEDS, tokens)


def v1_extra_hash(extra_keys: tuple | None) -> Key:
    if not extra_keys:
        return NO_EXTRA
    return v1_hash128(V1_BYTES_SEEDS, v1_bytes_words(msgspec.msgpack.encode(extra_keys)))


def v1_root_key(model: str, dtype: str, kv_layout: str, unit: int, tp_rank: int = 0, tp_size: int = 1,
                salt: str = "") -> Key:
    fingerprint = ["vllm-kvbm-block-key", 1, model, dtype, kv_layout, unit, tp_rank, tp_size, salt]
    return v1_hash128(V1_BYTES_SEEDS, v1_bytes_words(msgspec.msgpack.encode(fingerprint)))


def v1_unit_keys(tokens: Sequence[int], unit: int, root: Key, extras: Sequence[Key] | None = None) -> list[Key]:
    keys, parent = [], root
    for i in range(len(tokens) // unit):
        extra = extras[i] if extras is not None else NO_EXTRA
        parent = v1_hash128(V1_CHAIN_SEEDS, (*parent, *v1_token_hash(tokens[i * unit: (i + 1) * unit]), *extra))
        keys.append(parent)
    return keys
