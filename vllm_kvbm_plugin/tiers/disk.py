"""The disk block format and file layout (pure: bytes in, bytes out).

File: <root>/<layout fingerprint hex>/r<rank>/<key hex[:2]>/<key hex>.kvb, directories 0700,
files 0600, names derived only from hex. Content: a fixed header, a msgpack metadata blob, the
payload. A file is written to a temporary name in the same directory and renamed into place, so a
crash leaves either the whole block or no block. Reads check magic, version, key, fingerprint,
lengths and the 64-bit checksum of metadata and payload (hashing.kernels.checksum64, memory
speed): anything else is a miss, never data. A block is read straight into its destination.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from vllm_kvbm_plugin.hashing.kernels import checksum64

MAGIC = b"KVBM"
VERSION = 1
# magic, version, flags, key, layout fingerprint, payload length, meta length, checksum
_HEADER = struct.Struct("<4sHH16s16sQIQ")
HEADER_SIZE = _HEADER.size
SUFFIX = ".kvb"


def key_hex(key: tuple[int, int]) -> str:
    return f"{key[0]:016x}{key[1]:016x}"


def key_bytes(key: tuple[int, int]) -> bytes:
    return key[0].to_bytes(8, "big") + key[1].to_bytes(8, "big")


def parse_key_hex(name: str) -> tuple[int, int] | None:
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None
    if stem is None or len(stem) != 32:
        return None
    try:
        return int(stem[:16], 16), int(stem[16:], 16)
    except ValueError:
        return None


def block_dir(root: str, fingerprint: bytes, rank: int) -> str:
    return os.path.join(root, fingerprint.hex(), f"r{rank}")


def block_path(base: str, key: tuple[int, int]) -> str:
    h = key_hex(key)
    return os.path.join(base, h[:2], h + SUFFIX)


def _checksum(meta: bytes, payload: np.ndarray) -> int:
    cm = int(checksum64(np.frombuffer(meta, dtype=np.uint8))) if meta else 0
    return (int(checksum64(payload)) * 0x9E3779B97F4A7C15 + cm) & 0xFFFFFFFFFFFFFFFF


def encode(key: tuple[int, int], fingerprint: bytes, payload: np.ndarray, meta: bytes = b"") -> list:
    """The parts of a block file, to be written in order (the payload is not copied)."""
    payload = np.asarray(payload, dtype=np.uint8).reshape(-1)
    header = _HEADER.pack(MAGIC, VERSION, 0, key_bytes(key), fingerprint, payload.nbytes, len(meta),
                          _checksum(meta, payload))
    return [header, meta, payload]


def read_into(path: str, key: tuple[int, int], fingerprint: bytes, out: np.ndarray) -> bytes | None:
    """Read the block file at `path` into `out` (uint8, its exact payload size); returns its
    metadata, or None when the file is missing, truncated, corrupt, or for another key or layout
    (then `out` holds garbage and must not be used)."""
    try:
        with open(path, "rb", buffering=0) as f:
            head = f.read(HEADER_SIZE)
            if len(head) != HEADER_SIZE:
                return None
            magic, version, _flags, k, fp, plen, mlen, checksum = _HEADER.unpack(head)
            if (magic != MAGIC or version != VERSION or k != key_bytes(key) or fp != fingerprint
                    or plen != out.nbytes):
                return None
            meta = f.read(mlen)
            view = memoryview(out.reshape(-1))
            got = 0
            while got < plen:
                n = f.readinto(view[got:])
                if not n:
                    return None
                got += n
            if len(meta) != mlen or f.read(1):
                return None
    except OSError:
        return None
    return meta if _checksum(meta, out.reshape(-1)) == checksum else None


def read_meta(path: str) -> bytes | None:
    """The metadata blob of a block file (not verified: for inspection and indexing only)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
            if len(head) != HEADER_SIZE:
                return None
            magic, version, _f, _k, _fp, _plen, mlen, _c = _HEADER.unpack(head)
            if magic != MAGIC or version != VERSION:
                return None
            meta = f.read(mlen)
            return meta if len(meta) == mlen else None
    except OSError:
        return None


def write_atomic(path: str, parts: list, fsync: bool = False) -> None:
    """Write `parts` to `path` through a temporary file and a rename (0600 file, 0700 dirs)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for part in parts:
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)


def scan(base: str) -> list[tuple[tuple[int, int], int]]:
    """(key, file size) of every block file under `base`; leftover temporary files are removed."""
    out = []
    try:
        subdirs = os.listdir(base)
    except OSError:
        return out
    for sub in subdirs:
        d = os.path.join(base, sub)
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            path = os.path.join(d, name)
            if ".tmp" in name:
                try:
                    os.unlink(path)  # a write that never finished
                except OSError:
                    pass
                continue
            key = parse_key_hex(name)
            if key is not None:
                try:
                    out.append((key, os.stat(path).st_size))
                except OSError:
                    pass
    return out
