"""The CPU pool's host memory (tiers/host_memory.py): plain memory on CPU; on CUDA page-locked
memory of exactly the bytes asked, registered once and unregistered when the last view is gone.
No GPU here: the CUDA runtime's three calls are recorded by a stand-in, the memory is real."""

import gc
import mmap

import pytest
import torch

from vllm_kvbm_plugin.tiers import host_memory


class Runtime:
    """cudaHostRegister / Unregister / GetDevicePointer, recorded; registered memory is mapped
    at its host address (unified addressing), as on the GPUs vLLM runs on."""

    def __init__(self, rc: int = 0):
        self.rc, self.registered, self.unregistered = rc, [], []

    def register(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return self.rc

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)

    def device_pointer(self, ptr: int) -> int:
        return ptr


def test_without_pinning_the_pool_is_plain_memory():
    t = host_memory.allocate(3, 5000, pin=False, host=None)
    assert t.shape == (3, 5000) and t.dtype == torch.uint8 and not t.is_pinned()


@pytest.mark.parametrize("rows,row_bytes", [(5, 3 << 20), (7, 3_000_001), (1, 100)])
def test_pinned_pool_registers_exactly_the_bytes_asked(rows, row_bytes):
    """Not a power of two: 15 MiB registers 15 MiB (torch's caching host allocator pins 16)."""
    rt = Runtime()
    t = host_memory.allocate(rows, row_bytes, pin=True, host=rt)
    n = rows * row_bytes
    (ptr, size), = rt.registered
    assert size == -(-n // mmap.PAGESIZE) * mmap.PAGESIZE and size < n + mmap.PAGESIZE
    assert ptr == t.data_ptr() and ptr % mmap.PAGESIZE == 0
    assert t.shape == (rows, row_bytes) and t.is_contiguous()
    t[-1, -1] = 7
    view = t[-1].numpy()  # what disk writes and remote fetches hold on to
    del t
    gc.collect()
    assert rt.unregistered == [] and view[-1] == 7  # a view still uses it
    del view
    gc.collect()
    assert rt.unregistered == [ptr]


def test_memory_that_cannot_be_pinned_is_a_clear_error():
    rt = Runtime(rc=2)  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="cannot pin a CPU pool of .*cpu_bytes_to_use"):
        host_memory.allocate(4, 1 << 20, pin=True, host=rt)
    gc.collect()
    assert rt.unregistered == []  # never registered: nothing to undo
