"""reuse.rope: K stored at position p, re-rotated to q, equals K computed at q (float32: 1e-5;
bf16: within the model's own bf16 rounding); without the rotation the same check fails."""

import pytest
import torch

from vllm_kvbm_plugin.reuse.rope import RopeSpec, UnsupportedRope, rerotate, rotate

SPECS = {
    "llama-default": RopeSpec(head_size=64, rotary_dim=64),
    "gptj-style": RopeSpec(head_size=64, rotary_dim=64, is_neox_style=False),
    "partial-rotary": RopeSpec(head_size=64, rotary_dim=32, base=500000.0),
    "linear-4": RopeSpec.from_parameters(128, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000}),
    "llama3": RopeSpec.from_parameters(128, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}),
}
MAX_POS = 8192


def case(spec, n=256, heads=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(n, heads, spec.head_size, generator=g)  # K before RoPE
    p = torch.randint(0, MAX_POS, (n,), generator=g)
    q = torch.randint(0, MAX_POS, (n,), generator=g)
    return raw, p, q, spec.cos_sin_cache(MAX_POS)


def check(got, want, tol=1e-5):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > {tol:.1g}"


@pytest.mark.parametrize("name", SPECS)
def test_rerotated_k_equals_k_computed_at_new_position(name):
    spec = SPECS[name]
    raw, p, q, cache = case(spec)
    stored = rotate(raw, p, cache, spec.rotary_dim, spec.is_neox_style)
    at_q = rotate(raw, q, cache, spec.rotary_dim, spec.is_neox_style)
    moved = rerotate(stored, p, q, cache, spec.rotary_dim, spec.is_neox_style)
    check(moved, at_q)
    if spec.rotary_dim < spec.head_size:  # the non-rotary part is the raw K, untouched
        assert torch.equal(moved[..., spec.rotary_dim:], raw[..., spec.rotary_dim:])
    # rotation switched off (K copied as stored): the same check fails
    with pytest.raises(AssertionError, match="max error"):
        check(stored, at_q)


def test_same_position_is_identity_and_composition_holds():
    spec = SPECS["llama-default"]
    raw, p, q, cache = case(spec)
    stored = rotate(raw, p, cache, spec.rotary_dim)
    check(rerotate(stored, p, p, cache, spec.rotary_dim), stored, 1e-6)
    r = torch.randint(0, MAX_POS, p.shape)
    via_q = rerotate(rerotate(stored, p, q, cache, spec.rotary_dim), q, r, cache, spec.rotary_dim)
    check(via_q, rotate(raw, r, cache, spec.rotary_dim))


def rope_in_bf16(x, positions, cache, spec):
    """How a bf16 model applies RoPE: bf16 K, bf16 cos/sin table, bf16 arithmetic."""
    cos, sin = cache.to(torch.bfloat16)[positions].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x = x.to(torch.bfloat16)
    rot, rest = x[..., :spec.rotary_dim], x[..., spec.rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


@pytest.mark.parametrize("name", ["llama-default", "partial-rotary", "linear-4", "llama3"])
def test_bf16_within_the_models_own_rounding(name):
    """bf16 K stored at p, re-rotated in float32 and rounded once: no farther from the exact K at
    q than twice the model's own bf16 K at q is."""
    spec = SPECS[name]
    raw, p, q, cache = case(spec)
    raw = raw.to(torch.bfloat16).float()
    exact_q = rotate(raw, q, cache, spec.rotary_dim)
    stored = rope_in_bf16(raw, p, cache, spec)
    model_q = rope_in_bf16(raw, q, cache, spec)
    moved = rerotate(stored, p, q, cache, spec.rotary_dim)
    assert moved.dtype == torch.bfloat16
    model_err = (model_q.float() - exact_q).abs().max().item()
    err = (moved.float() - exact_q).abs().max().item()
    assert 0 < err <= 2 * model_err, (err, model_err)
    assert (stored.float() - exact_q).abs().max().item() > 20 * model_err  # no rotation: far off


def test_unsupported_variants_are_refused():
    for params in ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
                   {"rope_type": "dynamic", "factor": 2.0},
                   {"rope_type": "default", "mrope_section": [16, 24, 24]}):
        with pytest.raises(UnsupportedRope):
            RopeSpec.from_parameters(128, params)
    with pytest.raises(ValueError, match="past the cos/sin cache"):
        rotate(torch.zeros(1, 1, 64), torch.tensor([10]), SPECS["llama-default"].cos_sin_cache(8), 64)
    with pytest.raises(ValueError, match="differ in shape"):
        rerotate(torch.zeros(2, 1, 64), torch.tensor([0, 1]), torch.tensor([0]),
                 SPECS["llama-default"].cos_sin_cache(8), 64)


def test_from_parameters_reads_hf_keys():
    s = RopeSpec.from_parameters(128, {"type": "linear", "factor": 2, "rope_theta": 1e6,
                                       "partial_rotary_factor": 0.5})
    assert (s.rope_type, s.factor, s.base, s.rotary_dim) == ("linear", 2.0, 1e6, 64)
    assert RopeSpec.from_parameters(64, None) == RopeSpec(64, 64)
