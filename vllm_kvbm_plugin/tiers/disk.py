"""The disk block format and file layout (pure: bytes in, bytes out).

File: <root>/<layout fingerprint hex>/r<rank>/<key hex[:2]>/<key hex>.kvb, directories 0700,
files 0600, names derived only from hex. Content: a fixed header, a msgpack metadata blob, the
payload. A file is written to a temporary name in the same directory and renamed into place, so a
crash leaves either the whole block or no block. Reads check magic, version, key, fingerprint,
lengths and the CRC32 of metadata and payload: anything else is a miss, never data.
"""

from __future__ import annotations

import os
import struct
import zlib

MAGIC = b"KVBM"
VERSION = 1
_HEADER = struct.Struct("<4sHH16s16sQII")  # magic, version, flags, key, fingerprint, payload len, meta len, crc
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


def encode(key: tuple[int, int], fingerprint: bytes, payload: bytes | memoryview, meta: bytes = b"") -> list:
    """The parts of a block file, to be written in order (no payload copy)."""
    crc = zlib.crc32(payload, zlib.crc32(meta))
    header = _HEADER.pack(MAGIC, VERSION, 0, key_bytes(key), fingerprint, len(payload), len(meta), crc)
    return [header, meta, payload]


def decode(data: bytes | memoryview, key: tuple[int, int], fingerprint: bytes,
           payload_len: int) -> tuple[bytes, memoryview] | None:
    """(meta, payload) of a complete, uncorrupted block file for this key and layout, else None."""
    if len(data) < HEADER_SIZE:
        return None
    magic, version, _flags, k, fp, plen, mlen, crc = _HEADER.unpack_from(data)
    if (magic != MAGIC or version != VERSION or k != key_bytes(key) or fp != fingerprint
            or plen != payload_len or len(data) != HEADER_SIZE + mlen + plen):
        return None
    view = memoryview(data)
    meta = bytes(view[HEADER_SIZE : HEADER_SIZE + mlen])
    payload = view[HEADER_SIZE + mlen :]
    if zlib.crc32(payload, zlib.crc32(meta)) != crc:
        return None
    return meta, payload


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


def read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


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
