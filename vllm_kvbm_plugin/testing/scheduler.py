"""vLLM's real Scheduler built in-process without a model or workers.

Model outputs are simulated (one sampled token per running request per step), so scheduling,
prefix caching, eviction and KV events run exactly as in an engine. Used by tests and by the
scheduler-overhead benchmark.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from vllm_kvbm_plugin.events import types as ev


@dataclasses.dataclass
class HarnessConfig:
    model_dir: str | None = None  # a dir with a config.json; None = a generated Llama config
    block_size: int = 160  # (inflated) block of every group
    hash_block_size: int | None = 32  # prefix_match_unit; None = vLLM's default
    hybrid: bool = True  # a Mamba group + a full-attention group, else attention only
    num_blocks: int = 400
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    events: bool = True


def _config_only_model(max_len: int) -> str:
    """A directory holding only a Llama config.json: ModelConfig needs no weights or tokenizer."""
    import json
    import os
    import tempfile

    d = os.path.join(tempfile.gettempdir(), f"kvbm-config-only-llama-{max_len}")
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048,
           "max_position_embeddings": max_len, "torch_dtype": "float32"}
    path = os.path.join(d, "config.json")
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cfg, f)
    os.replace(tmp, path)
    return d


class SchedulerHarness:
    def __init__(self, cfg: HarnessConfig):
        self.cfg = cfg
        bs = cfg.block_size
        model_dir = cfg.model_dir or _config_only_model(cfg.max_model_len)
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True,
                                     dtype="float32", max_model_len=cfg.max_model_len),
            scheduler_config=SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=cfg.max_model_len,
                is_encoder_decoder=False,
                enable_chunked_prefill=True,
                async_scheduling=False,
            ),
            cache_config=CacheConfig(
                block_size=bs,
                enable_prefix_caching=True,
                mamba_cache_mode="align" if cfg.hybrid else "none",
                prefix_match_unit=cfg.hash_block_size if cfg.hybrid else None,
            ),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=cfg.events, publisher="null"),
        )
        groups = []
        if cfg.hybrid:
            groups.append(KVCacheGroupSpec(["model.layers.0.mixer"], MambaSpec(
                block_size=bs, shapes=((4, 4),), dtypes=(torch.float32,), mamba_cache_mode="align")))
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(
            block_size=bs, num_kv_heads=1, head_size=64, dtype=torch.float32)))
        kv_cache_config = KVCacheConfig(num_blocks=cfg.num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=groups)
        self.vllm_config.cache_config.num_gpu_blocks = cfg.num_blocks
        sched_bs, hbs = resolve_kv_cache_block_sizes(kv_cache_config, self.vllm_config)
        kv_cache_config.hash_block_size = hbs
        self.hash_block_size = hbs
        from vllm.v1.structured_output import StructuredOutputManager

        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=sched_bs,
            hash_block_size=hbs,
            log_stats=True,
        )
        fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(fn)
        self._hasher = get_request_block_hasher(hbs, fn)
        self._published: list = []  # vLLM's batches, as the publisher receives them
        self.scheduler.kv_event_publisher.publish = self._published.append
        # room for simulated image encoder outputs (the config-only model is text-only, which
        # would leave vLLM no encoder budget and stall requests that carry mm_features)
        self.scheduler.max_num_encoder_input_tokens = cfg.max_num_batched_tokens
        self.scheduler.encoder_cache_manager = type(self.scheduler.encoder_cache_manager).create_manager(
            cache_size=cfg.max_num_batched_tokens, vllm_config=self.vllm_config)
        self._ids = itertools.count()

    @property
    def batches(self) -> list[ev.KVEventBatch]:
        """Published batches through the wire format, as a subscriber sees them."""
        import msgspec

        enc = msgspec.msgpack.Encoder()
        return [ev.decode_batch(enc.encode(b)) for b in self._published]

    def add(self, prompt: list[int], max_tokens: int = 4, **request_kwargs) -> str:
        """Queue a request; request_kwargs go to vLLM's Request (e.g. cache_salt, mm_features)."""
        rid = f"r{next(self._ids)}"
        self.scheduler.add_request(Request(
            rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None, block_hasher=self._hasher, **request_kwargs))
        return rid

    def unit_hashes(self, tokens: list[int]) -> list:
        """The event-form hashes vLLM computes for each full hash unit of `tokens`."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        req = Request("probe", list(tokens), SamplingParams(max_tokens=1), None,
                      block_hasher=self._hasher)
        return [maybe_convert_block_hash(h) for h in req.block_hashes]

    def step(self) -> int:
        """One schedule + simulated model output; returns the number of scheduled tokens."""
        out = self.scheduler.schedule()
        rids = list(out.num_scheduled_tokens)
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=[[7] for _ in rids]))
        return out.total_num_scheduled_tokens

    def run(self) -> None:
        while self.scheduler.has_unfinished_requests():
            self.step()

    def reset_prefix_cache(self) -> bool:
        ok = self.scheduler.reset_prefix_cache()
        self.step()  # events are published from update_from_output
        return ok
