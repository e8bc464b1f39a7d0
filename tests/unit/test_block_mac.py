"""Block files carry a MAC under the tier secret (tiers/mac.py): whoever can write to the disk tier's
directory but does not hold the secret cannot plant KV the tier serves. A payload forged so that
the old checksum (format 2) still matches, a file with a valid MAC under another secret, and a
valid file of format 2 are all misses."""

import os
import struct

import numpy as np

from vllm_kvbm_plugin.testing.files import write_reference
from vllm_kvbm_plugin.tiers import block_dir, block_file
from vllm_kvbm_plugin.tiers.mac import mac_key

FP, KEY = bytes(range(16)), (0x1234, 0x5678)
MK, ATTACKER = mac_key(bytes(range(16, 32))), mac_key(bytes(range(100, 116)))
M64 = (1 << 64) - 1
CK, G = 0x9E3779B185EBCA87, 0x9E3779B97F4A7C15  # format 2's position key step and combiner


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def old_checksum64(data: bytes) -> int:
    """Format 2's checksum (sums of position-keyed words, no key): what anyone can compute."""
    padded = data + b"\0" * (-len(data) % 8)
    h1 = h2 = 0
    for i, (w,) in enumerate(struct.iter_unpack("<Q", padded)):
        y = w ^ ((i * CK) & M64)
        h1, h2 = (h1 + y) & M64, (h2 + (y & 0xFFFFFFFF) * (y >> 32)) & M64
    return _mix64(h1 ^ len(data)) ^ _mix64((h2 + G) & M64)


def old_header(payload: bytes, meta: bytes) -> bytes:
    total = (old_checksum64(payload) * G + (old_checksum64(meta) if meta else 0)) & M64
    return block_file._HEADER.pack(block_file.MAGIC, 2, 0, block_file.key_bytes(KEY), FP, len(payload), len(meta), total, 0)


def forged(payload: bytes) -> bytes:
    """Another payload with the same format-2 checksum: two position-keyed words swapped."""
    w = list(struct.unpack(f"<{len(payload) // 8}Q", payload))
    y1, y2 = w[1] ^ CK, w[2] ^ ((2 * CK) & M64)
    w[1], w[2] = y2 ^ CK, y1 ^ ((2 * CK) & M64)
    return struct.pack(f"<{len(w)}Q", *w)


def read(path: str, size: int):
    out = np.empty(size, dtype=np.uint8)
    meta = block_file.read_into(path, KEY, FP, MK, out)
    opened = block_file.open_verified(path, KEY, FP, MK, size)
    if opened is not None:
        os.close(opened[0])
    assert (meta is None) == (opened is None)
    return meta, out


def test_write_access_without_the_secret_cannot_plant_a_block(tmp_path):
    path = block_dir.block_path(str(tmp_path), KEY)
    payload = os.urandom(4096)
    block_file.write_block(path, KEY, FP, MK, np.frombuffer(payload, np.uint8), b"meta")
    assert read(path, 4096)[0] == b"meta"  # the genuine file
    genuine = open(path, "rb").read()
    fake = forged(payload)
    assert fake != payload and old_checksum64(fake) == old_checksum64(payload)
    # 1. the payload replaced, the header (and its MAC) kept
    write_reference(path, [genuine[:block_file.HEADER_SIZE], fake, b"meta"])
    assert read(path, 4096)[0] is None
    # 2. a complete file of the current format, its MAC made under another secret
    write_reference(path, block_file.encode(KEY, FP, ATTACKER, np.frombuffer(fake, np.uint8), b"meta"))
    assert read(path, 4096)[0] is None
    # 3. a valid file of format 2 (checksum, no MAC): old files are misses
    write_reference(path, [old_header(payload, b"meta"), payload, b"meta"])
    assert read(path, 4096)[0] is None
    # the verified reader serves the genuine file again (nothing above was a reader fault)
    write_reference(path, [genuine])
    meta, out = read(path, 4096)
    assert meta == b"meta" and out.tobytes() == payload
