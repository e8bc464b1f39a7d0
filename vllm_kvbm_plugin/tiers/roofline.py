"""The machine's peak for each kind of tier transfer, so achieved GB/s can be read as a share of it.

Measured once, when the connector's worker has its KV cache and pool (`measure_roofline`), on the
same memory the tiers use:
- cpu/store, cpu/load: one contiguous copy between the KV cache's storage and the pool (what a copy
  of scattered blocks can at best reach);
- disk/write: a sequential write of one file in the tier's directory, fdatasync'ed; disk/read (and
  disk/load): reading it back after dropping it from the page cache (POSIX_FADV_DONTNEED);
- remote/write, remote/read: one pipelined burst of SETs, then of GETs, of block-sized values.
Each figure is bytes per second, best of `reps`. Nothing here imports vLLM.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis
    import torch

DIRECTIONS = {"cpu_store": "copy_to_pool", "cpu_load": "copy_from_pool", "disk_write": "disk_write",
              "disk_read": "disk_read", "disk_load": "disk_read", "remote_write": "remote_write",
              "remote_read": "remote_read"}


def _best(reps: int, run: Callable[[], object]) -> float:
    """Seconds of the fastest of `reps` runs of `run()`."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def copy_peaks(kv_bytes: torch.Tensor, pool_bytes: torch.Tensor, reps: int = 3) -> dict[str, float]:
    """Bytes/s of one contiguous copy each way between two uint8 tensors of the same length (a
    stretch of the KV cache's storage and of the pool). The KV stretch is restored afterwards from
    a host copy (no device memory beyond what vLLM allocated)."""
    import torch

    n = kv_bytes.numel()
    saved = kv_bytes.to("cpu", copy=True)
    sync = torch.cuda.synchronize if kv_bytes.is_cuda else (lambda: None)

    def copy(dst, src):
        dst.copy_(src, non_blocking=True)
        sync()

    to_pool = _best(reps, lambda: copy(pool_bytes, kv_bytes))
    from_pool = _best(reps, lambda: copy(kv_bytes, pool_bytes))
    kv_bytes.copy_(saved)
    sync()
    return {"copy_to_pool": n / to_pool, "copy_from_pool": n / from_pool}


def disk_peaks(directory: str, nbytes: int = 64 << 20, chunk: int = 4 << 20, reps: int = 2) -> dict[str, float]:
    """Bytes/s of a sequential fdatasync'ed write of `nbytes` to a new file in `directory` (our tier
    directory: created exclusively, 0600, never through a symlink) and of reading it back from the
    device. The file is removed."""
    path = os.path.join(directory, f".roofline-{uuid.uuid4().hex}")
    block = os.urandom(chunk)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        def write():
            os.lseek(fd, 0, os.SEEK_SET)
            for _ in range(nbytes // chunk):
                os.write(fd, block)
            os.fdatasync(fd)

        def read():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.lseek(fd, 0, os.SEEK_SET)
            while os.read(fd, chunk):
                pass

        written = _best(reps, write)
        return {"disk_write": nbytes / written, "disk_read": nbytes / _best(reps, read)}
    finally:
        os.close(fd)
        os.unlink(path)


def remote_peaks(client: redis.Redis | redis.RedisCluster, value_bytes: int, count: int = 32, reps: int = 2) -> dict[str, float]:
    """Bytes/s of one pipelined burst of `count` SETs, then GETs, of `value_bytes`-byte values under
    keys of our own (removed afterwards) on a redis-py client."""
    keys = [f"kvbm:roofline:{uuid.uuid4().hex}:{i}".encode() for i in range(count)]
    value = os.urandom(value_bytes)

    def burst(op):
        pipe = client.pipeline(transaction=False)
        for k in keys:
            op(pipe, k)
        pipe.execute()

    try:
        written = _best(reps, lambda: burst(lambda p, k: p.set(k, value)))
        read = _best(reps, lambda: burst(lambda p, k: p.get(k)))
    finally:
        client.delete(*keys)
    total = count * value_bytes
    return {"remote_write": total / written, "remote_read": total / read}


def per_direction(peaks: dict[str, float]) -> dict[str, float]:
    """The peaks measured, keyed by the stats' `<tier>_<direction>`."""
    return {d: peaks[kind] for d, kind in DIRECTIONS.items() if kind in peaks}
