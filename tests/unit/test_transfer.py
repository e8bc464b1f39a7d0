"""The transfer engine (tiers/transfer.py) on CPU tensors: job ids and completion, every layout
stored to slots and loaded back to other blocks byte for byte, and the CUDA path's piece
descriptors and Triton kernel run on CPU addresses (memmove, Triton's interpreter)."""

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from vllm_kvbm_plugin.tiers import copy as tcopy
from vllm_kvbm_plugin.tiers import transfer
from vllm_kvbm_plugin.tiers.transfer import Layer, TransferEngine, block_pieces, piece_descriptors

NB = 12  # blocks per layer


def _layouts() -> dict:
    """vLLM's KV layouts in small: name -> (tensor, block dim)."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    page = torch.randint(0, 256, (NB, 1280), dtype=torch.uint8, generator=g)  # a padded state page
    return {
        "cpu_attn": (rnd(NB, 2, 16, 2 * 32), 0),  # [blocks, kv heads, block, K|V]
        "kv_split": (rnd(2, NB, 16, 2, 32), 1),  # [K/V, blocks, block, heads, head]
        "heads_outer": (rnd(2, NB, 16, 32).permute(1, 0, 2, 3), 0),  # pieces per head
        "mamba_state": (page.view(torch.float32)[:, :256].view(NB, 4, 64), 0),  # 1 KiB of a 1280 B page
    }


def _engine(tensors: list, slots: int, **kw) -> TransferEngine:
    layers, offset = [], 0
    for t, dim in tensors:
        layer = Layer(t, dim)
        layer.offset, offset = offset, offset + layer.nbytes
        layers.append(layer)
    pool = torch.zeros(slots, offset + 24, dtype=torch.uint8)  # slots longer than an entry
    return TransferEngine({"kv": [layers]}, pool, **kw)


def _blocks(t, dim, ids) -> torch.Tensor:
    return t.index_select(dim, torch.tensor(ids)).movedim(dim, 0).contiguous()


@pytest.mark.parametrize("name", list(_layouts()))
def test_every_layout_stores_and_loads_back_byte_for_byte(name):
    t, dim = _layouts()[name]
    other, _ = _layouts()["cpu_attn"]  # a second layer in the same slot
    eng = _engine([(t, dim), (other, 0)], slots=8)
    ids, slots, back = [3, 0, 11, 7], [5, 1, 0, 6], [1, 2, 4, 9]
    want, want_other = _blocks(t, dim, ids), _blocks(other, 0, ids)
    job = eng.submit([("kv", (b,), s) for b, s in zip(ids, slots)], to_pool=True)
    assert eng.get_finished()[0][0] == job
    eng.submit([("kv", (b,), s) for b, s in zip(back, slots)], to_pool=False)
    assert torch.equal(_blocks(t, dim, back).view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(_blocks(other, 0, back).view(torch.uint8), want_other.view(torch.uint8))


def test_job_ids_increase_and_each_is_reported_once_in_order():
    t, dim = _layouts()["cpu_attn"]
    eng = _engine([(t, dim)], slots=4)
    jobs = [eng.submit([("kv", (i,), i)], to_pool=i % 2 == 0) for i in range(4)]
    assert jobs == sorted(jobs) and len(set(jobs)) == 4
    done = eng.get_finished()
    assert [j for j, _ in done] == jobs and all(s >= 0 for _, s in done)
    assert eng.get_finished() == []
    eng.wait(), eng.wait_loads()  # nothing in flight on CPU: return at once


def test_out_of_range_blocks_or_slots_raise_and_leave_the_engine_usable():
    t, dim = _layouts()["kv_split"]  # the torch path
    u, _ = _layouts()["cpu_attn"]  # the page copies
    for tensors in ([(t, dim)], [(u, 0)]):
        eng = _engine(tensors, slots=2)
        with pytest.raises((IndexError, RuntimeError)):
            eng.submit([("kv", (NB,), 0)], to_pool=True)
        with pytest.raises((IndexError, RuntimeError)):
            eng.submit([("kv", (0,), 2)], to_pool=False)
        eng.submit([("kv", (1,), 1)], to_pool=True)
        assert len(eng.get_finished()) == 1


def _two_group_engine(slots: int, pad: int = 4) -> tuple:
    """Page layers in two groups of one kind (their own block ids) and a state kind; between them
    layers the torch path copies (blocks on dim 1; 12-byte blocks, last) and a Mamba-like padded page."""
    g = torch.Generator().manual_seed(1)
    attn = [torch.randn(NB, 2, 16, 64, generator=g).to(torch.bfloat16) for _ in range(3)]
    split = torch.randn(2, NB, 16, 2, 32, generator=g).to(torch.bfloat16)
    odd = torch.randint(0, 256, (NB, 12), dtype=torch.uint8, generator=g)  # 12-byte blocks
    page = torch.randint(0, 256, (NB, 1280), dtype=torch.uint8, generator=g)
    kv_layers = [[Layer(attn[0], 0), Layer(split, 1), Layer(attn[1], 0)], [Layer(attn[2], 0), Layer(odd, 0)]]
    state = [[Layer(page.view(torch.float32)[:, :256].view(NB, 4, 64), 0)]]
    for groups in (kv_layers, state):
        offset = 0
        for layer in (ly for ls in groups for ly in ls):
            layer.offset, offset = offset, offset + layer.nbytes
    width = max(sum(ly.nbytes for ls in gs for ly in ls) for gs in (kv_layers, state))
    pool = torch.zeros(slots, width + pad, dtype=torch.uint8)  # pad 4: 8-byte words
    return TransferEngine({"kv": kv_layers, "state": state}, pool), kv_layers, state


@pytest.mark.parametrize("pad", [4, 8])
def test_a_job_is_one_kernel_call_per_kind_and_bit_exact_across_groups(monkeypatch, pad):
    calls = []
    kernel = tcopy.copy_table
    monkeypatch.setattr(tcopy, "copy_table", lambda *a: (calls.append(a[0].shape[0]), kernel(*a)))
    monkeypatch.setattr(tcopy, "MIN_SPLIT_BYTES", 1 << 40)  # one chunk: count calls, not threads
    eng, kv_layers, state = _two_group_engine(slots=8, pad=pad)
    ids = [(3, 9), (0, 4), (11, 1)]  # a block id per group
    ops = [("kv", b, s) for b, s in zip(ids, (5, 1, 6))] + [("state", (7,), 2), ("state", (2,), 0)]
    want = {id(ly): _blocks(ly.tensor, ly.dim, [b[gi] for b in ids]).clone()
            for gi, ls in enumerate(kv_layers) for ly in ls}
    want_state = _blocks(state[0][0].tensor, 0, [7, 2]).clone()
    eng.submit(ops, to_pool=True)
    # the kv kind's three page layers (two groups) in one call, the state's in one; slots that are
    # not whole words: every layer on the torch path
    assert calls == ([3, 1] if pad == 4 else [])
    back = [((b[0] + 1) % NB, (b[1] + 2) % NB) for b in ids]
    eng.submit([("kv", b, s) for b, s in zip(back, (5, 1, 6))] + [("state", (8,), 2), ("state", (5,), 0)],
               to_pool=False)
    for gi, ls in enumerate(kv_layers):
        for ly in ls:  # every layer, the unaligned one on the torch path too
            got = _blocks(ly.tensor, ly.dim, [b[gi] for b in back])
            assert torch.equal(got.view(torch.uint8), want[id(ly)].view(torch.uint8))
    got = _blocks(state[0][0].tensor, 0, [8, 5])
    assert torch.equal(got.view(torch.uint8), want_state.view(torch.uint8))


@pytest.mark.parametrize("bad", ["block", "slot"])
def test_an_out_of_range_piece_anywhere_in_a_job_copies_nothing(bad):
    eng, _, _ = _two_group_engine(slots=4)
    ops = [("kv", (1, 2), 0), ("kv", (3, 4), 1), ("kv", (5, NB) if bad == "block" else (5, 6), 2 if bad == "block" else 4)]
    with pytest.raises(IndexError):
        eng.submit(ops, to_pool=True)
    assert not eng.pool.any()  # checked before the first byte moved (the second group's last block)
    eng.submit(ops[:2], to_pool=True)
    assert eng.pool[:2].any() and not eng.pool[2:].any()


def test_copy_jobs_of_the_wrong_shape_or_type_are_refused():
    pages, pool = np.zeros(4 * 8, np.uint64), np.zeros(2 * 8, np.uint64)
    table = np.array([tcopy.table_row(pages, 8, 0, 0, 1)], np.int64)
    cols = np.array([[1, 1]], np.int64)
    for t, c, p in [(table[:, :6], cols, pool), (table, cols.astype(np.int32), pool), (table, cols[0], pool),
                    (table, cols, pool.view(np.int64))]:
        with pytest.raises(TypeError):
            tcopy.copy_rows(np.ascontiguousarray(t), c, p, 8, True)
    with pytest.raises(TypeError):
        tcopy.table_row(pages.view(np.float64), 8, 0, 0, 1)
    with pytest.raises(IndexError):  # a part past the slot's end
        tcopy.copy_rows(np.array([tcopy.table_row(pages, 8, 4, 0, 1)], np.int64), cols, pool, 8, True)
    assert not pool.any()
    pages[8:16] = 7
    tcopy.copy_rows(table, cols, pool, 8, True)  # block 1 -> slot 1
    assert (pool[8:] == 7).all() and not pool[:8].any()


# ---- the CUDA path's pieces, run on CPU addresses ------------------------------------------------

@pytest.mark.parametrize("name", ["cpu_attn", "kv_split", "heads_outer", "mamba_state"])
def test_block_pieces_follow_the_slot_order(name):
    t, dim = _layouts()[name]
    offsets, piece = block_pieces(t, dim)
    assert len(offsets) * piece == t.select(dim, 0).numel() * t.element_size()
    assert {"cpu_attn": 1, "kv_split": 2, "heads_outer": 2, "mamba_state": 1}[name] == len(offsets)


def test_tiny_or_misaligned_pieces_take_the_torch_path():
    t = torch.zeros(NB, 16, 4, 8, dtype=torch.bfloat16).permute(0, 2, 1, 3)  # 16-byte pieces
    assert block_pieces(t, 0) is None
    assert block_pieces(torch.zeros(NB * 1024 + 1, dtype=torch.uint8)[1:].view(NB, 1024), 0) is None


def _pieced(name, slots=8):
    t, dim = _layouts()[name]
    eng = _engine([(t, dim)], slots)
    layer = eng.layers["kv"][0][0]
    layer.pieces = block_pieces(t, dim)
    layer.nbytes = len(layer.pieces[0]) * layer.pieces[1]  # CUDA: a block's data, not its page
    return t, dim, eng, layer


def _reference_pool(t, dim, layer, ids, slots, shape):
    ref = torch.zeros(shape, dtype=torch.uint8)
    transfer.layer_to_slots(layer, ids, slots, ref)
    return ref


@pytest.mark.parametrize("name", ["cpu_attn", "kv_split", "heads_outer", "mamba_state"])
def test_piece_descriptors_copy_what_the_torch_path_copies(name):
    t, dim, eng, layer = _pieced(name)
    ids, slots = np.array([[3], [0], [11]]), np.array([5, 1, 0])
    rows = eng.pool.data_ptr() + slots * eng.slot_bytes
    kv, row, words = piece_descriptors([(0, layer)], ids, rows)
    for s, d, w in zip(kv, row, words):
        ctypes.memmove(int(d), int(s), int(w) * 8)
    ref = _reference_pool(t, dim, layer, ids[:, 0].tolist(), slots.tolist(), eng.pool.shape)
    assert torch.equal(eng.pool, ref)
    back = np.array([[1], [2], [4]])
    kv, row, words = piece_descriptors([(0, layer)], back, rows)
    for s, d, w in zip(row, kv, words):
        ctypes.memmove(int(d), int(s), int(w) * 8)
    assert torch.equal(_blocks(t, dim, [1, 2, 4]).view(torch.uint8), _blocks(t, dim, [3, 0, 11]).view(torch.uint8))


_TRITON_SCRIPT = """
import numpy as np, torch
from vllm_kvbm_plugin.tiers import copy as tcopy
from vllm_kvbm_plugin.tiers import transfer
from tests.unit.test_transfer import _pieced, _reference_pool, _blocks
assert transfer.triton is not None
for name in ["kv_split", "heads_outer"]:
    t, dim, eng, layer = _pieced(name)
    ids, slots = np.array([[3], [0], [11]]), np.array([5, 1, 0])
    kv, row, words = transfer.piece_descriptors([(0, layer)], ids, eng.pool.data_ptr() + slots * eng.slot_bytes)
    desc = torch.from_numpy(np.concatenate([kv, row, words]))
    transfer._copy_pieces[(2,)](desc, len(kv), BLOCK=64)  # two programs take pieces in turn
    assert torch.equal(eng.pool, _reference_pool(t, dim, layer, [3, 0, 11], [5, 1, 0], eng.pool.shape)), name
    back = np.array([[1], [2], [4]])
    kv, row, words = transfer.piece_descriptors([(0, layer)], back, eng.pool.data_ptr() + slots * eng.slot_bytes)
    transfer._copy_pieces[(3,)](torch.from_numpy(np.concatenate([row, kv, words])), len(kv), BLOCK=64)
    assert torch.equal(_blocks(t, dim, [1, 2, 4]).view(torch.uint8), _blocks(t, dim, [3, 0, 11]).view(torch.uint8))
print("ok")
"""


def test_triton_kernel_copies_the_pieces():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("blocked", [("vllm", "msgspec"), ("vllm", "msgspec", "triton")])
def test_the_engine_and_gpu_check_import_without_vllm_or_msgspec(blocked):
    """What the bare GPU machine has: torch, numpy, numba (Triton there, but guarded)."""
    code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
            + "import torch\nfrom vllm_kvbm_plugin.tiers import transfer\n"
            "import runpy; runpy.run_path('benchmarks/gpu_check.py', run_name='not_main')\n"
            "t = torch.zeros(4, 2, 64)\n"
            "layer = transfer.Layer(t[0], 0)\n"
            "eng = transfer.TransferEngine({'kv': [[layer]]}, torch.zeros(2, layer.nbytes, dtype=torch.uint8))\n"
            "assert eng.get_finished() == [] and eng.submit([('kv', (1,), 0)], True) == 0\n"
            "assert [m for m in blocked_check if sys.modules.get(m)] == []\n"
            "print('ok', transfer.triton is None)")
    code = code.replace("blocked_check", repr(list(blocked)))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["ok", str("triton" in blocked)]
