"""The CPU pool's host memory. On CUDA it is pinned with exactly the bytes asked: an anonymous
mapping registered with cudaHostRegister. `torch.empty(pin_memory=True)` would go through torch's
caching host allocator, which rounds every allocation up to a power of two (a 40 GiB pool pins
64 GiB, per rank) and keeps it after the tensor is gone. Imports torch, never vLLM.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from vllm_kvbm_plugin.log import get_logger

logger = get_logger("tiers.host_memory")

_PORTABLE_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded into this process, or None (a CPU build)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        return ctypes.CDLL(sorted(paths)[0])
    except (OSError, IndexError):
        return None


class CudaHost:
    """The three runtime calls a pinned pool needs (tests pass a recording stand-in: no GPU here)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]

    def register(self, ptr: int, size: int) -> int:
        return self.lib.cudaHostRegister(ptr, size, _PORTABLE_MAPPED)

    def unregister(self, ptr: int) -> None:
        self.lib.cudaHostUnregister(ptr)

    def device_pointer(self, ptr: int) -> int | None:
        out = ctypes.c_void_p()
        return out.value if self.lib.cudaHostGetDevicePointer(ctypes.byref(out), ptr, 0) == 0 else None


class _Mapping(mmap.mmap):
    """Anonymous memory that unregisters itself once the last tensor viewing it is gone
    (torch.frombuffer keeps it alive until then)."""

    host: CudaHost | None = None
    address = 0

    def __del__(self):
        if self.host is not None:
            self.host.unregister(self.address)


def allocate(rows: int, row_bytes: int, pin: bool, host: CudaHost | None = None) -> torch.Tensor:
    """A [rows, row_bytes] uint8 tensor: plain memory, or (pin) page-locked memory of exactly
    rows * row_bytes rounded up to a page, which kernels also reach at its host address
    (cudaHostRegisterMapped; unified addressing). Where the device address differs, falls back
    to torch's pinned allocator (logged). Raises RuntimeError when the memory cannot be pinned."""
    if not pin:
        return torch.empty((rows, row_bytes), dtype=torch.uint8)
    if host is None:
        lib = cudart()
        if lib is None:
            raise RuntimeError("KVBMConnector: no CUDA runtime in this process to pin the CPU pool with")
        host = CudaHost(lib)
    n = rows * row_bytes
    size = max(1, -(-n // mmap.PAGESIZE)) * mmap.PAGESIZE
    m = _Mapping(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(m, dtype=torch.uint8)
    ptr = flat.data_ptr()
    rc = host.register(ptr, size)
    if rc:
        raise RuntimeError(f"KVBMConnector: cannot pin a CPU pool of {size} bytes (CUDA error {rc}); "
                           "lower cpu_bytes_to_use or raise the locked-memory limit")
    m.host, m.address = host, ptr
    if host.device_pointer(ptr) != ptr:  # kernels could not use the host address
        del flat, m  # unregistered as the mapping goes
        logger.warning("KVBMConnector: registered host memory has another device address here; "
                       "the CPU pool uses torch's pinned allocator (rounded up to a power of two)")
        return torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=True)
    return flat[:n].view(rows, row_bytes)
