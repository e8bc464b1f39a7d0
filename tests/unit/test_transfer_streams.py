"""The transfer engine's CUDA path (tiers/transfer.py) without a GPU: its streams, events and
staging run against a stand-in for the device that executes every copy at once on host memory
(memmove) and records what each queued operation would wait for on a GPU (the closure of stream
order, event waits and stream waits). So the bytes are checked and so is the ordering: the next
forward waits for a store's gather and never for its PCIe transfer, a long store does not hold
up the next store's gathers or the next load, and a store's transfer never overtakes a load
that reads its slot. benchmarks/gpu_check.py runs the same path on a real GPU."""

import contextlib
import ctypes
import itertools

import numpy as np
import pytest
import torch

from vllm_kvbm_plugin.tiers import transfer
from vllm_kvbm_plugin.tiers.transfer import Layer, TransferEngine, block_pieces

NB = 40


class Stream:
    def __init__(self, name: str):
        self.name, self.tail = name, frozenset()  # every operation a new one here waits for

    def wait_event(self, ev) -> None:
        self.tail |= ev.deps

    def wait_stream(self, other) -> None:
        self.tail |= other.tail


class Event:
    def __init__(self):
        self.deps, self.done = frozenset(), False

    def record(self, stream) -> None:
        self.deps = stream.tail

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, other) -> float:
        return 0.0


class HostDevice:
    """CudaOps' interface on host memory; operations are named (kind, stream, n)."""

    def __init__(self):
        self.stream, self.d2h, self.now = Stream("side"), Stream("d2h"), Stream("current")
        self.events: list[Event] = []
        self.count = itertools.count()
        self.waits: dict = {}  # operation -> what it waits for

    def current(self):
        return self.now

    def on_side(self):
        return contextlib.nullcontext()

    def event(self):
        self.events.append(Event())
        return self.events[-1]

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def _queue(self, stream, kind: str) -> None:
        op = (kind, stream.name, next(self.count))
        self.waits[op] = stream.tail
        stream.tail |= {op}

    def launch(self, stream, desc: np.ndarray, n: int, keep: list) -> None:
        for s, d, w in zip(desc[:n], desc[n:2 * n], desc[2 * n:]):
            ctypes.memmove(int(d), int(s), int(w) * 8)
        self._queue(stream, "kernel")

    def copy(self, stream, dst, dst_at: int, src, src_at: int, n: int) -> None:
        ctypes.memmove(dst.data_ptr() + dst_at, src.data_ptr() + src_at, n)
        self._queue(stream, "copy")

    def forward(self):
        """What the next operation on the current stream (the next forward) waits for."""
        return self.now.tail

    def finish(self) -> None:
        for ev in self.events:
            ev.done = True


def _engine(mode: str, layers: int = 2, slots: int = 32):
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randint(0, 256, (2, NB, 16, 64), dtype=torch.uint8, generator=g) for _ in range(layers)]
    built, offset = [], 0
    for t in tensors:
        layer = Layer(t, 1)  # K and V of a block: two pieces
        layer.pieces = block_pieces(t, 1)
        layer.nbytes = len(layer.pieces[0]) * layer.pieces[1]
        layer.offset, offset = offset, offset + layer.nbytes
        built.append(layer)
    dev = HostDevice()
    pool = torch.zeros(slots, offset, dtype=torch.uint8)
    return TransferEngine({"kv": [built]}, pool, mode, ops=dev), dev, tensors


@pytest.fixture
def small_staging(monkeypatch):
    """Staging of 4 rows (entries of 2 layers x 2 x 16 x 64 bytes) per buffer: a store of 12
    blocks takes 3 buffers."""
    monkeypatch.setattr(transfer, "STAGE_BYTES", 4 * 2 * 2 * 16 * 64)
    monkeypatch.setattr(transfer, "STAGE_LIMIT", 16 * transfer.STAGE_BYTES)


def _ops(ids, slots):
    return [("kv", (int(b),), int(s)) for b, s in zip(ids, slots)]


@pytest.mark.parametrize("mode", ["auto", "kernel", "dma"])
def test_every_byte_round_trips_through_staging(mode, small_staging):
    eng, dev, tensors = _engine(mode)
    before = [t.clone() for t in tensors]
    src, dst, slots = list(range(0, 12)), list(range(20, 32)), [9, 3, 4, 5, 17, 0, 1, 2, 30, 31, 12, 11]
    eng.submit(_ops(src, slots), to_pool=True)
    eng.submit(_ops(dst, slots), to_pool=False)
    for t, old in zip(tensors, before):
        want = old.clone()
        want[:, dst] = old[:, src]
        assert torch.equal(t, want)
    dev.finish()
    assert [j for j, _ in eng.get_finished()] == [0, 1]


def _submit(eng, dev, ops, to_pool: bool) -> set:
    """Submit a job; the copy-engine operations it queued (a store's PCIe transfer in dma mode)."""
    before = set(dev.waits)
    eng.submit(ops, to_pool)
    return {op for op in dev.waits if op not in before and op[0] == "copy"}


def test_the_next_forward_waits_for_the_gather_not_the_transfer(small_staging):
    eng, dev, _ = _engine("dma")
    moves = _submit(eng, dev, _ops(range(12), range(12)), True)
    assert moves and not moves & dev.forward()  # the PCIe transfer runs on meanwhile
    assert any(op[0] == "kernel" for op in dev.forward())  # the blocks were gathered first


def test_a_long_store_does_not_hold_up_the_next_store_or_load(small_staging):
    eng, dev, _ = _engine("dma")
    first = _submit(eng, dev, _ops(range(12), range(12)), True)  # a long prefill's: 3 staging buffers
    _submit(eng, dev, _ops(range(12, 24), range(12, 24)), True)  # the next step's store
    assert not first & dev.forward()  # its gathers took new buffers
    _submit(eng, dev, _ops(range(24, 28), range(4)), False)  # a load of a slot stored long ago
    assert not first & dev.forward()
    assert len(eng._stages) == 7  # the load's rows took one more buffer


def test_staging_is_bounded_and_a_reused_buffer_waits_for_its_transfer(small_staging, monkeypatch):
    monkeypatch.setattr(transfer, "STAGE_LIMIT", 2 * transfer.STAGE_BYTES)
    eng, dev, _ = _engine("dma")
    moves = _submit(eng, dev, _ops(range(12), range(12)), True)  # 3 chunks, 2 buffers
    assert len(eng._stages) == 2
    assert moves & dev.forward()  # the third chunk's gather waited for the first chunk's transfer
    dev.finish()  # transfers done: their buffers are free again, nothing more is allocated
    eng.submit(_ops(range(12, 20), range(12, 20)), to_pool=True)
    assert len(eng._stages) == 2


def test_a_store_never_overwrites_a_slot_a_load_in_flight_reads():
    eng, dev, _ = _engine("dma")
    load = _submit(eng, dev, _ops([1, 2], [5, 6]), False)
    writes = _submit(eng, dev, _ops([7, 8], [5, 6]), True)  # the slots were freed and reused
    assert load and writes and all(load <= dev.waits[op] for op in writes)


def test_loads_land_before_the_forward_reads_them():
    for mode in ("kernel", "dma"):
        eng, dev, _ = _engine(mode)
        eng.submit(_ops([1, 2], [5, 6]), to_pool=False)
        assert dev.stream.tail <= dev.forward()
