"""Re-rotating stored K from the positions it was computed at to new positions (pure torch).

RoPE rotates each pair of K's rotary dimensions by the angle position * inv_freq[i]. K of a token
stored at position p therefore becomes K at position q by undoing the rotation at p and applying
the one at q: V and the non-rotary part of K do not depend on the position at all. Done in float32
with the same cos/sin table layout vLLM's RotaryEmbedding uses (`cos_sin_cache`: [position,
rotary_dim] = cat(cos, sin)), so K re-rotated from p equals K computed at q up to float32 rounding.

Only RoPE variants whose angle is a fixed multiple of the position can be re-rotated exactly:
`default`, `linear` and `llama3` (per-frequency rescaled inv_freq). Others (YaRN scales cos/sin,
dynamic NTK depends on the sequence length, M-RoPE has 3-D positions) raise `UnsupportedRope`:
for them a reused run is a plain miss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

EXACT_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedRope(ValueError):
    """A RoPE variant that cannot be re-rotated exactly."""


@dataclass(frozen=True)
class RopeSpec:
    """What decides a model's RoPE angles (vLLM's get_rope arguments, HF's rope_parameters)."""

    head_size: int
    rotary_dim: int
    base: float = 10000.0
    is_neox_style: bool = True
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.rope_type not in EXACT_ROPE_TYPES:
            raise UnsupportedRope(f"rope_type {self.rope_type!r} cannot be re-rotated exactly "
                                  f"(supported: {', '.join(EXACT_ROPE_TYPES)})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_size:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, {self.head_size}]")

    @classmethod
    def from_parameters(cls, head_size: int, rope_parameters: dict[str, Any] | None = None,
                        is_neox_style: bool = True) -> "RopeSpec":
        """From the rope_parameters dict vLLM's get_rope takes (rope_theta, rope_type, factor, ...;
        HF's older `rope_scaling` uses the same keys, with `type` for `rope_type`)."""
        p = dict(rope_parameters or {})
        rope_type = p.get("rope_type", p.get("type")) or "default"
        if p.get("mrope_section") or p.get("use_fope"):
            raise UnsupportedRope(f"rope_parameters {p} (multi-dimensional or Fourier RoPE)")
        rotary_dim = p.get("rope_dim") or int(head_size * p.get("partial_rotary_factor", 1.0))
        kw: dict[str, Any] = {}
        if rope_type in ("linear", "llama3"):
            kw["factor"] = float(p["factor"])
        if rope_type == "llama3":
            kw.update(low_freq_factor=float(p["low_freq_factor"]),
                      high_freq_factor=float(p["high_freq_factor"]),
                      original_max_position=int(p["original_max_position_embeddings"]))
        return cls(head_size, rotary_dim, float(p.get("rope_theta", 10000.0)), is_neox_style,
                   rope_type, **kw)

    def inv_freq(self) -> torch.Tensor:
        """float32 [rotary_dim / 2] angle per position of each rotary pair."""
        inv = 1.0 / (self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
        if self.rope_type != "llama3":
            return inv
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a linear blend between
        wavelen = 2 * math.pi / inv
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        smooth: torch.Tensor | float = 0.0
        if self.low_freq_factor != self.high_freq_factor:
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * inv / self.factor + smooth * inv
        return torch.where(wavelen < high_wavelen, inv,
                           torch.where(wavelen > low_wavelen, inv / self.factor, blended))

    def cos_sin_cache(self, max_position: int, dtype: torch.dtype = torch.float) -> torch.Tensor:
        """float32 [max_position, rotary_dim]: cat(cos, sin) of every position's angles, as vLLM
        lays its RotaryEmbedding.cos_sin_cache out (linear: positions divided by the factor).
        `dtype`: the values rounded to it, as vLLM's forward uses the table in the model's dtype
        (K re-rotated with the rounded table is nearer to the K the model computes at the new
        position: issue 32's fidelity)."""
        t = torch.arange(max_position, dtype=torch.float)
        if self.rope_type == "linear":
            t = t / self.factor
        angles = torch.outer(t, self.inv_freq())
        return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype).float()


def rotate(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, rotary_dim: int,
           is_neox_style: bool = True, inverse: bool = False) -> torch.Tensor:
    """RoPE of x [tokens, heads, head_size] at `positions` [tokens] (inverse: undo it), computed
    in float32 and returned in x's dtype; dimensions past rotary_dim pass through."""
    if x.dim() != 3 or positions.shape != x.shape[:1]:
        raise ValueError(f"x must be [tokens, heads, head_size] with one position per token, got "
                         f"{tuple(x.shape)} and positions {tuple(positions.shape)}")
    if positions.numel() and int(positions.max()) >= cache.shape[0]:
        raise ValueError(f"position {int(positions.max())} is past the cos/sin cache ({cache.shape[0]})")
    xf = x.float()
    cos, sin = cache.float().index_select(0, positions.long()).chunk(2, dim=-1)
    if inverse:  # the exact inverse, also of a rounded table's (not quite orthonormal) rotation
        norm = cos * cos + sin * sin
        cos, sin = cos / norm, -sin / norm
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    if is_neox_style:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., ::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1).to(x.dtype)


def rerotate(k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
             cache: torch.Tensor, rotary_dim: int, is_neox_style: bool = True) -> torch.Tensor:
    """K [tokens, heads, head_size] computed at old_positions, as it is at new_positions: the
    rotation at the old position undone and the new one applied in float32, one rounding to k's
    dtype at the end. `cache`: a float32 cos/sin table (`RopeSpec.cos_sin_cache`, or the model's
    own when it is float32)."""
    if old_positions.shape != new_positions.shape:
        raise ValueError(f"old and new positions differ in shape: {tuple(old_positions.shape)} "
                         f"vs {tuple(new_positions.shape)}")
    kf = rotate(k.float(), old_positions, cache, rotary_dim, is_neox_style, inverse=True)
    return rotate(kf, new_positions, cache, rotary_dim, is_neox_style).to(k.dtype)
