"""Files other processes hold, for the disk tier's tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import os
import subprocess
import sys

if TYPE_CHECKING:
    import numpy as np


def locked_writer(path: str, seconds: int) -> subprocess.Popen[str]:
    """A process that creates `path` the way a block writer makes its temporary file (O_EXCL,
    0600) and holds an exclusive flock on it for `seconds`; returns once the lock is held."""
    writer = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, time\n"
        f"fd = os.open({path!r}, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        f"time.sleep({seconds})\n")], stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None  # stdout=PIPE
    if writer.stdout.readline().strip() != "locked":
        writer.kill()
        raise RuntimeError(f"the writer could not lock {path}")
    return writer


def write_reference(path: str, parts: list) -> None:
    """The block file format written by plain Python (a temporary file renamed into place, 0600,
    missing directories 0700): the reference the disk tier's own writer is compared against."""
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def reference_mac(key: np.ndarray, head: bytes, payload: bytes, meta: bytes) -> int:
    """The block MAC (tiers/mac.py) written from its definition with numpy and Python integers:
    the reference the numba kernels are compared against."""
    import numpy as np

    from vllm_kvbm_plugin.hashing.spec import siphash
    from vllm_kvbm_plugin.tiers.mac import CHUNK_WORDS

    p, lo32 = (1 << 61) - 1, np.uint64(0xFFFFFFFF)
    nh = np.asarray(key[4:], dtype=np.uint64)
    padded = bytes(payload) + b"\0" * (-len(payload) % 8)
    words = np.frombuffer(padded, dtype=np.uint64)
    h = 0
    for at in range(0, len(words), CHUNK_WORDS):
        x = words[at:at + CHUNK_WORDS]
        sums = []
        for k in (nh[:len(x)], nh[1:len(x) + 1]):  # the Toeplitz shift: one key word
            a = (x + k) & lo32
            b = ((x >> np.uint64(32)) + (k >> np.uint64(32))) & lo32
            sums.append(int((a * b).sum(dtype=np.uint64)))
        for y in sums:
            h = (h * int(key[0]) + (y >> 32)) % p
            h = (h * int(key[0]) + (y & 0xFFFFFFFF)) % p
    prf = int(key[1]).to_bytes(8, "little") + int(key[2]).to_bytes(8, "little")
    return siphash(prf, bytes(head[:48]) + bytes(head[48:52]) + b"\0" * 4 + h.to_bytes(8, "little") + bytes(meta),
                   wide=False)
