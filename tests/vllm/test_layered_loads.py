"""CPU-tier loads behind the forward (worker side, real CPU-layout KV tensors): the blocks the
forward itself writes are loaded before it, the others layer by layer as each attention waits."""

import types

import torch

from vllm_kvbm_plugin.connector.layout import KV
from vllm_kvbm_plugin.connector.metadata import KVBMMetadata, Load
from vllm_kvbm_plugin.testing.worker import cpu_layout_worker


def _context(names, slots):
    return types.SimpleNamespace(slot_mapping={n: torch.tensor(slots) for n in names})


def test_loads_run_behind_the_forward_except_the_blocks_it_writes():
    w, buf = cpu_layout_worker(3, 8, (2, 32, 16), slots=4)
    names = list(w._kv_layers)
    w._copy([Load(KV, (1,), 0), Load(KV, (2,), 1)], to_pool=True)
    want1, want2 = buf[:, 1].clone(), buf[:, 2].clone()
    meta = KVBMMetadata(loads=[Load(KV, (5,), 0), Load(KV, (6,), 1)])
    context = _context(names, [6 * 32 + 3, -1])  # the forward writes one token into block 6

    buf[:, 5:7].zero_()
    w.start_load_kv(meta, context)  # no forward seen waiting for its layers yet: all copied now
    assert w.copies._layered is None and torch.equal(buf[:, 5], want1) and torch.equal(buf[:, 6], want2)
    for n in names:  # what a forward's attention layers do
        w.wait_for_layer_load(n)
    w.wait_for_save(meta)

    buf[:, 5:7].zero_()
    w.start_load_kv(meta, context)
    assert torch.equal(buf[:, 6], want2)  # before the forward writes into it
    _, copy, _ = w.copies._layered  # block 5 behind the forward
    assert [job[3].tolist() for job in copy.jobs] == [[5]] * 3
    for i, n in enumerate(names):
        w.wait_for_layer_load(n)
        assert torch.equal(buf[i, 5], want1[i])
    w.wait_for_save(meta)
    assert w.copies._layered is None and w.get_stats().data["cpu_load_blocks"] == 4

    # a context that does not say what the forward writes into every KV layer: all copied now
    partial = _context(names[1:], [6 * 32 + 3])
    micro_batches = types.SimpleNamespace(slot_mapping=[context.slot_mapping])
    for ctx in (None, partial, micro_batches):
        buf[:, 5:7].zero_()
        w.start_load_kv(meta, ctx)
        assert w.copies._layered is None and torch.equal(buf[:, 5], want1) and torch.equal(buf[:, 6], want2)
