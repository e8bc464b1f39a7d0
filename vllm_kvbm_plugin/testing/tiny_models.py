"""Tiny random-weight models with locally trained tokenizers, for tests, demos and benchmarks.

Nothing comes from a model hub: configs are written here, weights are drawn from a fixed seed and
the tokenizer is trained on a generated corpus, so two builds give the same files. Builds are cached
in a directory keyed by kind and spec version.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
from collections.abc import Sequence
from typing import Any

SPEC_VERSION = 1
KINDS = ("llama", "llama-wide", "qwen3next", "llama-big", "llama-local", "qwen2vl", "llava", "granite-hybrid")
# Qwen2-VL placeholders, in the tokenizer of the qwen2vl kind
VISION_SPECIAL = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
LLAVA_IMAGE_TOKENS = 16  # a 56x56 CLIP input in 14-pixel patches, CLS dropped

_WORDS = (
    "the a kv cache block hash token prefix router model engine request offload tier disk cpu "
    "memory layer attention mamba state image text prompt reply system user assistant chat "
    "document query answer fast slow small large first last next previous shared unique event "
    "store load evict keep drop page unit chain parent child root leaf node tree index key value"
).split()


def _corpus(n_lines: int = 4000) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n_lines)]


def _build_tokenizer(out: pathlib.Path, vocab_size: int, extra_special: Sequence[str] = ()) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=list(extra_special),
    )
    fast.save_pretrained(out)
    return fast


def _config(kind: str) -> Any:
    if kind == "llama-wide":  # another tiny model: tests that models sharing a disk never mix
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                           pad_token_id=3, tie_word_embeddings=False)
    if kind in ("llama", "llama-big"):
        from transformers import LlamaConfig

        big = kind == "llama-big"
        return LlamaConfig(
            vocab_size=2048,
            hidden_size=1024 if big else 128,
            intermediate_size=2816 if big else 256,
            num_hidden_layers=8 if big else 2,
            num_attention_heads=16 if big else 4,
            num_key_value_heads=4 if big else 2,
            head_dim=64 if big else 32,
            max_position_embeddings=4096 if big else 2048,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
            tie_word_embeddings=False,
        )
    if kind == "llama-local":  # see _make_local
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                           max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                           tie_word_embeddings=False, attention_bias=True)
    if kind == "qwen3next":
        from transformers import Qwen3NextConfig

        # The CPU GDN kernel needs linear head dim 128, and vLLM needs at least one MoE layer.
        return Qwen3NextConfig(
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            max_position_embeddings=2048,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
            tie_word_embeddings=False,
        )
    if kind == "granite-hybrid":
        from transformers import GraniteMoeHybridConfig

        # Mamba2 + attention, dense (no experts). Mamba page: conv 3*(256+2*16)*2 B + SSM state
        # 8*32*16*4 B (float32) = 18112 B; attention 2*2*32*2 = 256 B per token, so vLLM inflates
        # --block-size 32 to 96. On CPU, Mamba2's align mode (prefix caching) needs
        # max_num_batched_tokens equal to that block size (docs: vllm-on-cpu notes, case 5).
        return GraniteMoeHybridConfig(
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=256,
            shared_intermediate_size=256,
            num_hidden_layers=2,
            layer_types=["mamba", "attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=0,
            num_experts_per_tok=0,
            mamba_n_heads=8,
            mamba_n_groups=1,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=64,
            position_embedding_type="rope",
            max_position_embeddings=2048,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
            tie_word_embeddings=False,
        )
    if kind == "qwen2vl":
        from transformers import Qwen2VLConfig

        # special token ids 4..7 follow <unk> <s> </s> <pad> in the trained tokenizer
        image, video, start, end = 5, 7, 4, 6
        return Qwen2VLConfig(
            text_config=dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [4, 6, 6]},
                             bos_token_id=1, eos_token_id=2, pad_token_id=3),
            vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
            image_token_id=image, video_token_id=video, vision_start_token_id=start,
            vision_end_token_id=end, bos_token_id=1, eos_token_id=2, pad_token_id=3,
            tie_word_embeddings=False)
    if kind == "llava":
        from transformers import LlavaConfig

        # <image> is token 4, right after <unk> <s> </s> <pad> in the trained tokenizer
        return LlavaConfig(
            vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14,
                               projection_dim=64),
            text_config=dict(model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3),
            image_token_index=4, image_seq_length=LLAVA_IMAGE_TOKENS, tie_word_embeddings=False)
    raise ValueError(f"unknown tiny model kind {kind!r}; valid kinds: {', '.join(KINDS)}")


LOCAL_WINDOW = 16  # llama-local: layer 0 attends to the last 16 tokens


def _make_local(model: Any, window: int) -> None:
    """llama-local's weights: layer 0 attends only to the last `window` tokens (whatever they are),
    the top layer to everything. That is the structure selective recompute relies on (CacheBlend's
    premise: a reused chunk's KV deviates in a few tokens), here exactly: a document reused at
    another position has KV that deviates only in its first `window` tokens. Uniform random weights
    spread the deviation over every token, and no choice of 15% can remove half of it (docs/reuse.md).

    Layer 0's q and k are constant vectors (zero weights, biases only): after RoPE their product
    depends on the distance d alone, sum_i Re(z_i e^{i d theta_i}) over the rotary frequencies.
    The z_i are a ridge fit of that sum to 0 for d < window and -1 beyond, scaled so the softmax
    leaves less than 1e-6 of the attention outside the window. Larger V, O and LM-head weights
    than the 0.02 default make that context matter to the logits (KL well above rounding).
    """
    import numpy as np
    import torch

    cfg = model.config
    hd, sharp = cfg.head_dim, 40.0
    theta = cfg.rope_parameters["rope_theta"] ** (-np.arange(0, hd, 2) / hd)
    d = np.arange(4096)
    basis = np.concatenate([np.cos(np.outer(d, theta)), np.sin(np.outer(d, theta))], 1)
    weight = np.where(d < 4 * window, 10.0, 1.0)[:, None]
    a = basis * weight
    target = np.where(d < window, 0.0, -1.0)[:, None] * weight
    coef = np.linalg.solve(a.T @ a + 1e-2 * len(d) * np.eye(hd), a.T @ target)[:, 0]
    # pair i of q and k (dims i and i + hd/2) as complex numbers Q, K: its score term is
    # Re(Z e^{i d theta_i}) / sqrt(hd) with Z = Q conj(K), that is Re Z cos - Im Z sin: for the fitted
    # cos and sin coefficients a and b, Z = (a - i b) * sharp * sqrt(hd); K is real, Q = Z / K
    z = (coef[: hd // 2] - 1j * coef[hd // 2 :]) * sharp * np.sqrt(hd)
    kappa = np.sqrt(np.abs(z).max())
    q = np.concatenate([z.real, z.imag]) / kappa
    k = np.concatenate([np.full(hd // 2, kappa), np.zeros(hd // 2)])
    heads = cfg.num_attention_heads
    torch.manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.bias.zero_()
            if i == 0:
                attn.q_proj.weight.zero_()
                attn.k_proj.weight.zero_()
                attn.q_proj.bias.copy_(torch.tensor(np.tile(q, heads)))
                attn.k_proj.bias.copy_(torch.tensor(np.tile(k, cfg.num_key_value_heads)))
                attn.v_proj.weight.normal_(0, 0.3)
                attn.o_proj.weight.normal_(0, 0.3)
            else:
                attn.q_proj.weight.normal_(0, 0.1)
                attn.k_proj.weight.normal_(0, 0.1)
                attn.v_proj.weight.normal_(0, 0.2)
                attn.o_proj.weight.normal_(0, 0.2)
        model.lm_head.weight.normal_(0, 0.5)


def default_cache_dir() -> pathlib.Path:
    root = os.environ.get("KVBM_TINY_MODELS") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-kvbm", "tiny-models"
    )
    return pathlib.Path(root)


def build(kind: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return the directory of the tiny model `kind`, building it once."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(kind)
    out = pathlib.Path(cache_dir or default_cache_dir()) / f"{kind}-v{SPEC_VERSION}"
    if (out / ".complete").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if kind == "qwen2vl":
        from transformers import Qwen2VLForConditionalGeneration, Qwen2VLProcessor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        tok = _build_tokenizer(tmp, 2048, VISION_SPECIAL)
        assert [tok.convert_tokens_to_ids(t) for t in VISION_SPECIAL] == [4, 5, 6, 7]
        Qwen2VLForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(tmp)
        Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224),
                         tokenizer=tok, video_processor=Qwen2VLVideoProcessor()).save_pretrained(tmp)
    elif kind == "llava":
        from safetensors.torch import load_file, save_file
        from transformers import LlavaForConditionalGeneration, LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        tok = _build_tokenizer(tmp, 2048, ["<image>"])
        assert tok.convert_tokens_to_ids("<image>") == config.image_token_index
        LlavaForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(tmp)
        # transformers 5 saves the CLIP tower without its vision_model level, where vLLM looks
        weights = tmp / "model.safetensors"
        tensors = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v
                   for k, v in load_file(weights).items()}
        save_file(tensors, weights, metadata={"format": "pt"})
        LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 56},
                                                             crop_size={"height": 56, "width": 56}),
                       tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                       num_additional_image_tokens=1).save_pretrained(tmp)
    elif kind == "llama-local":
        _build_tokenizer(tmp, config.vocab_size)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _make_local(model, LOCAL_WINDOW)
        model.to(torch.bfloat16).save_pretrained(tmp)
    else:
        _build_tokenizer(tmp, config.vocab_size)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / ".complete").write_text(str(SPEC_VERSION))
    if out.exists():  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return out
    os.replace(tmp, out)
    return out
