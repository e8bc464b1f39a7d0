"""Which models position-independent loads serve (issue 12): checked once, where KVBMConnector is
built, in every process that builds one (the scheduler's and each worker's).

Only models whose K we can re-rotate exactly take part (`model_support`): dense Llama / Mistral /
Qwen2 / Qwen3 with `default`, `linear` or `llama3` RoPE, on vLLM's CPU attention with its "vec"
kernels (the one KV layout checked against a real forward, `reuse.cpu_layout.kv_views`), no
hybrid or MLA caches. For every other model the planner (connector/pic_planner.py) is off: a
plain miss. The answer rides on the connector's config (`KVBMConfig.pic_model`), where the
scheduler's planner and the workers' loads (connector/pic_load.py) read it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from vllm_kvbm_plugin.reuse.rope import RopeSpec, UnsupportedRope

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_kvbm_plugin.config import KVBMConfig

# dense decoders whose attention applies get_rope(head_dim, rope_parameters, neox) to K as is
ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


@dataclasses.dataclass(frozen=True)
class PicModel:
    """What the workers need to re-rotate the model's K: its RoPE and the largest position.

    Built by `model_support` where the connector is built (`with_model_support`), carried as
    `KVBMConfig.pic_model`; read by the scheduler's `PicPlanner.create` (planner on or off) and
    by each worker's `pic_load.load` (the rotation)."""

    rope: RopeSpec
    max_positions: int


def with_model_support(cfg: KVBMConfig | None, vllm_config: VllmConfig) -> KVBMConfig | None:
    """`cfg` (a KVBMConfig, or None when KVBMConnector is not configured) with `pic_model` filled
    from the model: a PicModel, or why its K cannot be re-rotated (a string)."""
    if cfg is None:
        return None
    return dataclasses.replace(cfg, pic_model=model_support(vllm_config))


def model_support(vllm_config: VllmConfig) -> PicModel | str:
    """The model's RoPE if its stored K can be re-rotated exactly, else the reason it cannot."""
    from vllm.platforms import current_platform

    mc = getattr(vllm_config, "model_config", None)
    if mc is None or getattr(mc, "hf_config", None) is None:
        return "no model config"
    if not current_platform.is_cpu():
        return "KV layouts other than vLLM's CPU layout are not supported yet"
    isa = _cpu_attention_isa(vllm_config)
    if isa != "vec":
        return f"CPU attention kernels {isa!r}: only the 'vec' KV layout is supported"
    archs = set(getattr(mc.hf_config, "architectures", None) or ())
    if not archs & ARCHITECTURES:
        return f"architecture {sorted(archs)} is not one of {sorted(ARCHITECTURES)}"
    if mc.use_mla:
        return "MLA caches a latent, not K"
    hf = mc.hf_text_config
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    params = dict(params)
    if "rope_theta" not in params and getattr(hf, "rope_theta", None) is not None:
        params["rope_theta"] = hf.rope_theta
    try:
        return PicModel(RopeSpec.from_parameters(mc.get_head_size(), params, is_neox_style=True),
                        int(mc.max_model_len))
    except (UnsupportedRope, ValueError, KeyError) as e:
        return f"RoPE cannot be re-rotated exactly: {e}"


def _cpu_attention_isa(vllm_config: VllmConfig) -> str | None:
    """Which kernels vLLM's CPU attention picks for this model (they lay K out differently)."""
    try:
        import torch
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        mc, cc = vllm_config.model_config, vllm_config.cache_config
        dtype = mc.dtype  # a torch.dtype once vLLM resolved the config (its annotation also allows the name)
        assert isinstance(dtype, torch.dtype)
        return _get_attn_isa(dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype)
    except Exception as e:  # noqa: BLE001 - another vLLM: unknown kernels
        return f"unknown ({e})"
