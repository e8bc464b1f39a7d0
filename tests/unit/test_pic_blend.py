"""The blend of selective recompute (patches/pic_blend.py) on hand-made tensors: which reused
tokens keep their fresh KV and which get the loaded one, per layer."""

import torch

from vllm_kvbm_plugin.reuse.cpu_layout import kv_views
from vllm_kvbm_plugin.patches import pic_blend

B, D = 4, 2


def layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def setup(monkeypatch):
    monkeypatch.setattr(pic_blend, "_request_of", lambda rows, name: torch.zeros(len(rows), dtype=torch.long))
    cache = torch.zeros(3, 1, B, 2 * D)  # [blocks, heads, block, 2 * head]: vLLM's CPU layout
    k_cache, v_cache = kv_views(cache)
    loaded_k = torch.arange(8, dtype=torch.float32).view(4, 1, D) + 1
    loaded_v = -loaded_k
    block, at = torch.ones(B, dtype=torch.long), torch.arange(B)
    k_cache[block, :, :, at] = loaded_k  # tokens of slots 4..7 (block 1), as pic.load leaves them
    v_cache[block, :, at] = loaded_v
    # the batch: five tokens at slots 9, 4, 5, 6, 7 (the first one is not reused); fresh KV = loaded
    # + a deviation, largest for the token at slot 6
    slot_mapping = torch.tensor([9, 4, 5, 6, 7])
    dev = torch.tensor([0.0, 0.1, 0.2, 3.0, 0.3])[:, None, None]
    key = torch.cat([torch.full((1, 1, D), 7.0), loaded_k]) + dev
    value = torch.cat([torch.full((1, 1, D), 7.0), loaded_v]) + dev
    plan = pic_blend.BlendPlan(torch.tensor([4, 5, 6, 7]), torch.tensor([True, False, False, False]), 0.25, B)
    return plan, cache, slot_mapping, key, value, loaded_k, loaded_v


def test_below_the_selection_layer_fresh_kv_stays(monkeypatch):
    plan, cache, sm, key, value, _, _ = setup(monkeypatch)
    k, v = plan.blend(layer(0), key, value, cache, sm)
    assert k is key and v is value and plan.keep is None


def test_the_most_deviating_and_the_run_heads_keep_fresh_kv(monkeypatch):
    plan, cache, sm, key, value, loaded_k, loaded_v = setup(monkeypatch)
    for i in (1, 2):  # the selection layer, then a later one: the same choice
        k, v = plan.blend(layer(i), key, value, cache, sm)
        # ratio 0.25 of 4 reused tokens: the one at slot 6 (largest deviation); plus the run's head (slot 4)
        assert plan.keep.tolist() == [True, False, True, False]
        assert torch.equal(k[[0, 1, 3]], key[[0, 1, 3]]) and torch.equal(v[[0, 1, 3]], value[[0, 1, 3]])
        assert torch.equal(k[[2, 4]], loaded_k[[1, 3]]) and torch.equal(v[[2, 4]], loaded_v[[1, 3]])
    assert torch.equal(key[2], loaded_k[1] + 0.2)  # the model's own tensors are left alone


def test_ratio_1_keeps_every_fresh_kv(monkeypatch):
    plan, cache, sm, key, value, _, _ = setup(monkeypatch)
    plan.ratio = 1.0
    k, v = plan.blend(layer(1), key, value, cache, sm)
    assert k is key and v is value and plan.keep.all()


def test_tokens_not_computed_this_step_are_left_out(monkeypatch):
    plan, cache, sm, key, value, _, _ = setup(monkeypatch)
    k, v = plan.blend(layer(1), key[:3], value[:3], cache, sm[:3])  # a chunk: slots 6 and 7 come next step
    assert plan.rows.tolist() == [1, 2]


def test_attach_hands_the_plan_to_that_step_only_and_leaves_the_graph_where_rows_drop(monkeypatch):
    from vllm.forward_context import ForwardContext

    plan = pic_blend.BlendPlan(torch.tensor([4]), torch.tensor([True]), 0.15, B)
    step, other = (ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}) for _ in range(2))
    monkeypatch.setattr(pic_blend, "compute_saving_applied", lambda: False)
    pic_blend.attach(step, plan)
    assert pic_blend.plan_of(step) is plan and pic_blend.plan_of(other) is None
    assert not step.skip_compiled  # rows are not dropped: the compiled graph computes the blend
    monkeypatch.setattr(pic_blend, "compute_saving_applied", lambda: True)
    pic_blend.attach(other, plan)
    assert other.skip_compiled  # the decoder layers drop rows: this step runs the model eagerly
