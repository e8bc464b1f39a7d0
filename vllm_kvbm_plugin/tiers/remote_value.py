"""The remote tier's values: one Redis / Valkey key per entry and rank, the value the same bytes as
a disk block file (tiers/block_file.py: header with key, layout fingerprint, lengths, MAC under the
tier secret; payload; metadata), so a value is verified exactly as a file is: anyone who can write
to the server but does not hold the secret cannot plant a value we serve. The server may evict any
key at any time. How values travel to and from the server: tiers/resp.py.
"""

from __future__ import annotations

import re

import numpy as np

from vllm_kvbm_plugin.tiers import block_file
from vllm_kvbm_plugin.tiers.mac import mac_final, mac_update


def key_prefix(root: tuple[int, int], rank: int) -> str:
    """Keys of one layout (model, dtype, KV spec, hash unit) and rank; the disk format version
    names the value format. A value's name is the prefix and its key's hex (block_dir.key_hex)."""
    return f"kvbm:{block_file.VERSION}:{root[0]:016x}{root[1]:016x}:r{rank}:"


_VALUE_NAME = re.compile(rb"kvbm:(\d+):([0-9a-f]{32}):r(\d+):([0-9a-f]{32})")


def parse_value_name(name: bytes) -> tuple[bytes, int, bytes] | None:
    """(layout root hex, rank, key hex) of a value name in the current format, else None."""
    m = _VALUE_NAME.fullmatch(name)
    if m is None or int(m.group(1)) != block_file.VERSION:
        return None
    return m.group(2), int(m.group(3)), m.group(4)


def value_name(root_hex: bytes, rank: int, key_hex: bytes) -> bytes:
    return b"kvbm:%d:%s:r%d:%s" % (block_file.VERSION, root_hex, rank, key_hex)


def value_parts(key: tuple[int, int], fingerprint: bytes, mac_key: np.ndarray, payload: np.ndarray, meta: bytes) -> list:
    """The value of `key`: a disk block file's bytes, as parts (the payload is not copied)."""
    return block_file.encode(key, fingerprint, mac_key, payload, meta)


MISSING, BAD, OK = 0, 1, 2  # outcomes of a value's read (resp.DirectClient.fetch, classify)


def classify(reply: bytes | Exception | None, key: tuple[int, int], fingerprint: bytes, mac_key: np.ndarray, out: np.ndarray) -> int:
    """MISSING, BAD or OK for one GET reply of redis-py (raise_on_error=False), verified into
    `out` as read_value does. A key of another type under our name is BAD (as
    resp.DirectClient reads it); any other error is the server's, not the value's: raised."""
    if reply is None:
        return MISSING
    if isinstance(reply, Exception):
        if str(reply).startswith("WRONGTYPE"):
            return BAD
        raise reply
    return OK if read_value(reply, key, fingerprint, mac_key, out) else BAD


def read_value(value: bytes | None, key: tuple[int, int], fingerprint: bytes, mac_key: np.ndarray, out: np.ndarray) -> bool:
    """Verify a value read from the store and copy its payload into `out` (uint8, the exact
    payload size). False for anything but a complete value of `key` written under `fingerprint`
    and the tier secret of `mac_key` (then `out` holds garbage and must not be used)."""
    out = out.reshape(-1)
    plen = out.nbytes
    if value is None or len(value) < block_file.HEADER_SIZE + plen:
        return False
    buf = np.frombuffer(value, dtype=np.uint8)
    h = block_file.parse_header(value)
    if not header_fits(h, key, fingerprint, plen, len(value)):
        return False
    acc = np.zeros(3, dtype=np.uint64)
    mac_update(acc, mac_key, buf[block_file.HEADER_SIZE: block_file.HEADER_SIZE + plen], 0, out)
    assert h is not None  # header_fits
    return int(mac_final(acc, mac_key, buf[:block_file.HEADER_SIZE], buf[block_file.HEADER_SIZE + plen:])) == h.mac


def header_fits(h: block_file.Header | None, key: tuple[int, int], fingerprint: bytes, plen: int, size: int) -> bool:
    """A value of `size` bytes with header `h` is a complete value of `key` under `fingerprint`
    with a `plen`-byte payload (its MAC still to be verified)."""
    return (h is not None and h.key == block_file.key_bytes(key) and h.fingerprint == fingerprint
            and h.payload_bytes == plen and block_file.HEADER_SIZE + plen + h.meta_bytes == size)

