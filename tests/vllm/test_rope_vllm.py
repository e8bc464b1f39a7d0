"""reuse.rope against vLLM's own rotary embedding (get_rope): the same cos/sin table, and K that
vLLM rotated at p, re-rotated to q, equals vLLM's K at q (float32: 1e-5; bf16: within vLLM's own
bf16 rounding), including every layer-0 KV head of a tiny Llama, whose layer-0 K and V do not
depend on context. Without the rotation the same checks fail."""

import json

import pytest
import torch
from safetensors.torch import load_file
from vllm.model_executor.layers.rotary_embedding import get_rope

from vllm_kvbm_plugin.reuse.rope import RopeSpec, rerotate, rotate
from vllm_kvbm_plugin.testing import tiny_models

PARAMS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024, "rope_theta": 500000.0},
    "partial": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}
HEAD, MAX_POS = 64, 4096


@pytest.fixture(autouse=True)
def vllm_config():
    """vLLM's custom ops (RotaryEmbedding) need a current config to pick their forward."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def vllm_rope(params, dtype, neox=True, head=HEAD):
    return get_rope(head, MAX_POS, is_neox_style=neox, rope_parameters=dict(params), dtype=dtype)


def vllm_k(rope, raw, positions):
    """K rotated by vLLM's forward_native: raw [tokens, heads, head] -> same shape."""
    n, heads, head = raw.shape
    q = torch.zeros(n, heads * head, dtype=raw.dtype)
    _, k = rope.forward_native(positions, q, raw.reshape(n, heads * head).clone())
    return k.reshape(n, heads, head)


@pytest.mark.parametrize("name", PARAMS)
@pytest.mark.parametrize("neox", [True, False])
def test_same_table_and_float32_rerotation_as_vllm(name, neox):
    rope = vllm_rope(PARAMS[name], torch.float32, neox)
    spec = RopeSpec.from_parameters(HEAD, PARAMS[name], neox)
    assert spec.rotary_dim == rope.rotary_dim
    ours = spec.cos_sin_cache(rope.cos_sin_cache.shape[0])
    torch.testing.assert_close(ours, rope.cos_sin_cache, rtol=0, atol=1e-6)
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(300, 4, HEAD, generator=g)
    p = torch.randint(0, MAX_POS, (300,), generator=g)
    q = torch.randint(0, MAX_POS, (300,), generator=g)
    stored, at_q = vllm_k(rope, raw, p), vllm_k(rope, raw, q)
    for cache in (ours, rope.cos_sin_cache):  # our table or vLLM's own
        moved = rerotate(stored, p, q, cache, spec.rotary_dim, neox)
        assert (moved - at_q).abs().max().item() <= 1e-5
    assert (stored - at_q).abs().max().item() > 1.0  # rotation switched off


@pytest.mark.parametrize("name", ["default", "llama3"])
def test_bf16_within_vllms_own_rounding(name):
    rope32, rope16 = vllm_rope(PARAMS[name], torch.float32), vllm_rope(PARAMS[name], torch.bfloat16)
    spec = RopeSpec.from_parameters(HEAD, PARAMS[name])
    g = torch.Generator().manual_seed(2)
    raw = torch.randn(300, 4, HEAD, generator=g).to(torch.bfloat16)
    p = torch.randint(0, MAX_POS, (300,), generator=g)
    q = torch.randint(0, MAX_POS, (300,), generator=g)
    exact_q = vllm_k(rope32, raw.float(), q)
    model_q = vllm_k(rope16, raw, q)
    moved = rerotate(vllm_k(rope16, raw, p), p, q, spec.cos_sin_cache(MAX_POS), spec.rotary_dim)
    model_err = (model_q.float() - exact_q).abs().max().item()
    assert (moved.float() - exact_q).abs().max().item() <= 2 * model_err
    assert (vllm_k(rope16, raw, p).float() - exact_q).abs().max().item() > 20 * model_err


def layer0_kv(weights, config, tokens, dtype):
    """Layer 0's K (after vLLM's RoPE at positions 0..n-1), V and K before RoPE of a tiny Llama, as
    vLLM computes them: embedding, RMSNorm in float32, k/v projections and RoPE in `dtype`."""
    heads, head = config["num_key_value_heads"], config["head_dim"]
    x = weights["model.embed_tokens.weight"][tokens].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])
    x = (x * weights["model.layers.0.input_layernorm.weight"].float()).to(dtype)
    k = (x @ weights["model.layers.0.self_attn.k_proj.weight"].to(dtype).T).reshape(-1, heads, head)
    v = (x @ weights["model.layers.0.self_attn.v_proj.weight"].to(dtype).T).reshape(-1, heads, head)
    rope = get_rope(head, config["max_position_embeddings"], is_neox_style=True,
                    rope_parameters=config["rope_parameters"], dtype=dtype)
    return vllm_k(rope, k, torch.arange(len(tokens))), v, k


def test_tiny_llama_layer0_reused_run_equals_full_prefill():
    """A document at position 37 in one prompt and 301 in another: its layer-0 K from the first,
    re-rotated, is the second prompt's own layer-0 K on every head (V is the same as is)."""
    path = tiny_models.build("llama")
    config = json.loads((path / "config.json").read_text())
    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    doc = torch.randint(10, 2000, (120,), generator=g)
    a = torch.cat([torch.randint(10, 2000, (37,), generator=g), doc])
    b = torch.cat([torch.randint(10, 2000, (301,), generator=g), doc, torch.randint(10, 2000, (9,), generator=g)])
    old, new = torch.arange(37, 157), torch.arange(301, 421)
    spec = RopeSpec.from_parameters(config["head_dim"], config["rope_parameters"])
    cache = spec.cos_sin_cache(config["max_position_embeddings"])
    for dtype in (torch.float32, torch.bfloat16):
        ka, va, _ = layer0_kv(weights, config, a, dtype)
        kb, vb, raw_b = layer0_kv(weights, config, b, dtype)
        moved = rerotate(ka[37:], old, new, cache, spec.rotary_dim)
        torch.testing.assert_close(va[37:], vb[301:421], rtol=0, atol=0)
        err = (moved.float() - kb[301:421].float()).abs().max().item()
        off = (ka[37:].float() - kb[301:421].float()).abs().max().item()  # copied, not rotated
        if dtype == torch.float32:
            assert err <= 1e-5, err
        else:  # within bf16 rounding of vLLM's own bf16 K at the new positions
            exact = rotate(raw_b[301:421].float(), new, cache, spec.rotary_dim)
            model_err = (kb[301:421].float() - exact).abs().max().item()
            assert (moved.float() - exact).abs().max().item() <= 2 * model_err
        assert off > 100 * max(err, 1e-4), (off, err)
