"""vLLM's real Scheduler built in-process without a model or workers.

Model outputs are simulated (one sampled token per running request per step), so scheduling,
prefix caching, eviction and KV events run exactly as in an engine. Used by tests and by the
scheduler-overhead benchmark.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
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
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from vllm_kvbm_plugin.events import types as ev

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_kvbm_plugin.connector.metadata import KVBMMetadata
    from vllm_kvbm_plugin.connector.scheduler import SchedulerSide

# request id -> (its tokens, first and end position computed this step, its block ids per group, new)
Spans = dict[str, tuple[Sequence[int], int, int, tuple[list[int], ...], bool]]


@dataclasses.dataclass
class HarnessConfig:
    """How a SchedulerHarness builds vLLM's config: model, geometry, KV events, and
    KVBMConnector's extra config with the number of simulated workers."""

    model_dir: str | None = None  # a dir with a config.json; None = a generated Llama config
    block_size: int = 160  # (inflated) block of every group
    hash_block_size: int | None = 32  # prefix_match_unit; None = vLLM's default
    hybrid: bool = True  # a Mamba group + a full-attention group, else attention only
    num_blocks: int = 400
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    events: bool = True
    pipeline: int = 1  # vLLM's pipeline_parallel_size (the harness simulates one stage's workers)
    # KVBMConnector's kv_connector_extra_config: the connector's scheduler side runs inside vLLM's
    # Scheduler and `workers` real WorkerSides (tensor-parallel ranks) run its plans over CPU tensors
    connector: dict | None = None
    workers: int = 1
    kv_load_failure_policy: str | None = None  # None: vLLM's default


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


def vllm_config_of(cfg: HarnessConfig, kv_transfer_config: KVTransferConfig | None) -> VllmConfig:
    """vLLM's config for a harness: the model, scheduler and cache settings of `cfg`."""
    bs = cfg.block_size
    model_dir = cfg.model_dir or _config_only_model(cfg.max_model_len)
    return VllmConfig(
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
        parallel_config=ParallelConfig(tensor_parallel_size=cfg.workers, pipeline_parallel_size=cfg.pipeline),
        kv_transfer_config=kv_transfer_config,
    )


class SchedulerHarness:
    """vLLM's real Scheduler in the calling process (a test's or a benchmark's), with simulated
    model outputs (module docstring): owns the scheduler, its published event batches, and with
    a connector configured the SimulatedWorkers that run the connector's plans. Tests and
    benchmarks drive it: `add` requests, `step` / `run` / `serve`, read `batches`."""

    def __init__(self, cfg: HarnessConfig) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config_of(cfg, self._kv_transfer_config())
        kv_cache_config, sched_bs, hbs = self._kv_cache_config()
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
        self._published: list[Any] = []  # vLLM's batches, as the publisher receives them
        self.scheduler.kv_event_publisher.publish = self._published.append  # type: ignore[method-assign, assignment]
        # room for simulated image encoder outputs (the config-only model is text-only, which
        # would leave vLLM no encoder budget and stall requests that carry mm_features)
        self.scheduler.max_num_encoder_input_tokens = cfg.max_num_batched_tokens
        self.scheduler.encoder_cache_manager = type(self.scheduler.encoder_cache_manager).create_manager(
            cache_size=cfg.max_num_batched_tokens, vllm_config=self.vllm_config)
        self._ids = itertools.count()
        self.cached_tokens: dict[str, int] = {}  # request id -> tokens it started with (prefix cache + tiers)
        self.workers = self._workers(kv_cache_config)

    def _kv_transfer_config(self) -> KVTransferConfig | None:
        if self.cfg.connector is None:
            return None
        policy: dict[str, Any] = (
            {"kv_load_failure_policy": self.cfg.kv_load_failure_policy} if self.cfg.kv_load_failure_policy else {})
        return KVTransferConfig(kv_connector="KVBMConnector", kv_connector_module_path="vllm_kvbm_plugin.connector",
                                kv_role="kv_both", kv_connector_extra_config=self.cfg.connector, **policy)

    def _workers(self, kv_cache_config: KVCacheConfig) -> list[SimulatedWorker]:
        return [] if self.cfg.connector is None else [
            SimulatedWorker(self.vllm_config, kv_cache_config, rank) for rank in range(self.cfg.workers)]

    def _kv_cache_config(self) -> tuple[KVCacheConfig, int, int]:
        """(scheduler KVCacheConfig, scheduler block size, hash block size): a Mamba group (hybrid)
        and an attention group of one layer each, every group's block `block_size`."""
        cfg, bs = self.cfg, self.cfg.block_size
        groups: list[KVCacheGroupSpec] = []
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
        return kv_cache_config, sched_bs, hbs

    @property
    def batches(self) -> list[ev.KVEventBatch]:
        """Published batches through the wire format, as a subscriber sees them."""
        import msgspec

        enc = msgspec.msgpack.Encoder()
        return [ev.decode_batch(enc.encode(b)) for b in self._published]

    def add(self, prompt: list[int], max_tokens: int = 4, extra_args: dict[str, Any] | None = None,
            **request_kwargs: Any) -> str:
        """Queue a request; extra_args go to its SamplingParams (e.g. kv_cache_report_mode),
        request_kwargs to vLLM's Request (e.g. cache_salt, mm_features)."""
        rid = f"r{next(self._ids)}"
        self.scheduler.add_request(Request(
            rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args),
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
        for r in out.scheduled_new_reqs:
            self.cached_tokens.setdefault(r.req_id, r.num_computed_tokens)
        kv_output = self._run_workers(out, rids)
        # like the model runner: a chunk that leaves the prompt unfinished samples nothing
        reqs = self.scheduler.requests
        sampled = [[] if reqs[r].num_computed_tokens < reqs[r].num_tokens else [7] for r in rids]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=sampled, kv_connector_output=kv_output))
        return out.total_num_scheduled_tokens

    def _run_workers(self, out: SchedulerOutput, rids: list[str]) -> KVConnectorOutput | None:
        """The workers' part of a step: the connector's plans and the simulated forward."""
        if not self.workers:
            return None
        spans = self._spans(out, rids)
        meta, invalid, recved, failed = None, set(), None, set()
        for w in self.workers:
            wm = w.run_step(out, spans)
            meta = wm if meta is None else (meta.aggregate(wm) if wm is not None else meta)
            invalid |= w.side.take_load_errors()  # as the model runner asks each step
            done, bad = w.side.take_recving()  # vLLM's KVOutputAggregator: done once every worker is
            recved = done if recved is None else recved & done
            failed |= bad
        return KVConnectorOutput(kv_connector_worker_meta=meta, invalid_block_ids=invalid,
                                 finished_recving=recved or None, failed_recving=failed & (recved or set()))

    def _spans(self, out: SchedulerOutput, rids: list[str]) -> Spans:
        """request id -> (its tokens, first and end position computed this step, its block ids per
        group, whether it is new this step)."""
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        new_ids = set(computed)
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        spans: Spans = {}
        for rid in rids:
            req = self.scheduler.requests[rid]
            start = computed[rid]
            spans[rid] = (req.all_token_ids, start, start + out.num_scheduled_tokens[rid],
                          self.scheduler.kv_cache_manager.get_block_ids(rid), rid in new_ids)
        return spans

    def settle(self) -> None:
        """Let the workers' background disk writes finish and their reports reach the scheduler."""
        for w in self.workers:
            w.side.wait_for_disk()
        self.step()

    @property
    def connector(self) -> SchedulerSide:
        """KVBMConnector's scheduler side (SchedulerSide)."""
        from vllm_kvbm_plugin.connector import KVBMConnector

        connector = self.scheduler.connector
        assert isinstance(connector, KVBMConnector) and connector._sched is not None
        return connector._sched

    def run(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.scheduler.has_unfinished_requests():
            self.step()
            assert deadline is None or time.monotonic() < deadline, "requests did not finish"

    def serve(self, tokens: list[int], max_tokens: int = 2, **request_kwargs: Any) -> int:
        """One request to completion (every step checks the KV it finds) and its background
        writes settled; the tokens it started with (prefix cache + tiers)."""
        rid = self.add(tokens, max_tokens=max_tokens, **request_kwargs)
        self.run(timeout=30)
        self.settle()
        return self.cached_tokens[rid]

    def reset_prefix_cache(self) -> bool:
        ok = self.scheduler.reset_prefix_cache()
        self.step()  # events are published from update_from_output
        return ok


class SimulatedWorker:
    """A tensor-parallel rank: KVBMConnector's real WorkerSide over KV tensors in vLLM's CPU layout,
    and a stand-in forward that writes, for every computed token, its id and position into its
    KV slot (channels 0 and 1) and, into the block of a step's last token, the recurrent state
    (its position and the sum of the tokens before it). `check` compares every block a request
    holds with what that forward would have written: a tier load of wrong bytes, or into the
    wrong block, fails it."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, rank: int) -> None:
        from vllm_kvbm_plugin.config import connector_config
        from vllm_kvbm_plugin.connector.layout import Layout
        from vllm_kvbm_plugin.connector.pic_model import with_model_support
        from vllm_kvbm_plugin.connector.worker import WorkerSide

        cfg = with_model_support(connector_config(vllm_config), vllm_config)  # as KVBMConnector builds it
        assert cfg is not None, "the harness's vLLM config names KVBMConnector"
        layout = Layout.from_vllm(vllm_config, kv_cache_config, cfg, decide=False)  # follows the first step's
        n = kv_cache_config.num_blocks
        self.tensors: dict[str, torch.Tensor] = {}
        self.attention: list[torch.Tensor] = []
        self.state: list[torch.Tensor] = []
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            for name in group.layer_names:
                if isinstance(spec, MambaSpec):
                    self.tensors[name] = torch.zeros(n, *spec.shapes[0], dtype=torch.float32)
                    self.state.append(self.tensors[name])
                else:
                    assert isinstance(spec, AttentionSpec)
                    self.tensors[name] = torch.zeros(n, spec.num_kv_heads, spec.block_size, 2 * spec.head_size,
                                                     dtype=torch.float32)
                    self.attention.append(self.tensors[name])
        self.groups = layout.groups
        self.block_size = layout.block_size
        self.side = WorkerSide(layout, cfg, rank)
        self.side.register_kv_caches(self.tensors)

    def run_step(self, out: SchedulerOutput, spans: Spans) -> Any:
        """One step as vLLM's model runner orders it: zero new blocks, copy-on-write copies of
        partial prefix-cache hits, the connector's loads, the forward, the connector's stores."""
        for t in self.tensors.values():
            if out.new_block_ids_to_zero:
                t[torch.tensor(out.new_block_ids_to_zero)] = 0
            for copy in getattr(out, "kv_cache_block_copies", None) or ():
                t[copy.dst_block_id] = t[copy.src_block_id]
        meta = cast("KVBMMetadata | None", out.kv_connector_metadata)  # KVBMConnector's scheduler side's
        if meta:
            self.side.start_load_kv(meta)
        self.check(spans)
        queries = getattr(meta, "pic_queries", None) or {}
        for rid, (tokens, start, end, block_ids, _new) in spans.items():
            # a step may compute several segments of a request around loaded runs (pic_segments)
            for s, c in queries[rid][1] if rid in queries else ((start, end - start),):
                self._forward(tokens, s, s + c, block_ids)
        if meta:
            self.side.wait_for_save(meta)
        return self.side.build_worker_meta()

    def _kv_group(self) -> int:
        from vllm_kvbm_plugin.connector.layout import KV

        return self.groups[KV][0]

    def _forward(self, tokens: Sequence[int], start: int, end: int, block_ids: tuple[list[int], ...]) -> None:
        B, ids = self.block_size, block_ids[self._kv_group()]
        pos = torch.arange(start, end)
        blocks = torch.tensor([ids[p // B] for p in range(start, end)])
        for t in self.attention:
            t[blocks, :, pos % B, 0] = torch.tensor(tokens[start:end], dtype=torch.float32)[:, None]
            t[blocks, :, pos % B, 1] = pos.to(torch.float32)[:, None]
        if self.state and end > 0:
            from vllm_kvbm_plugin.connector.layout import STATE

            block = block_ids[self.groups[STATE][0]][(end - 1) // B]
            for t in self.state:
                t[block].view(-1)[:2] = torch.tensor([end, sum(tokens[:end]) % 65536], dtype=torch.float32)

    def check(self, spans: Spans) -> None:
        """Before the forward: every token a request already has (computed before, hit in vLLM's
        prefix cache or loaded from a tier) sits in its block with its id and position, and a new
        request that starts after a hit finds the state at the hit. A request's tokens from a
        block whose load failed this step (reported to vLLM, which recomputes them) are not checked."""
        B, failed = self.block_size, self.side.load_errors
        for rid, (tokens, start, _end, block_ids, new) in spans.items():
            ids = block_ids[self._kv_group()]
            lost = [i for i in range(-(-start // B)) if ids[i] in failed] if failed else []
            if lost:
                start, new = lost[0] * B, False
            if start == 0:
                continue
            pos = torch.arange(start)
            blocks = torch.tensor([ids[p // B] for p in range(start)])
            want_tokens = torch.tensor(tokens[:start], dtype=torch.float32)
            for t in self.attention:
                got = t[blocks, 0, pos % B]
                wrong = ((got[:, 0] != want_tokens) | (got[:, 1] != pos.to(torch.float32))).nonzero()
                if len(wrong):
                    p = int(wrong[0])
                    raise AssertionError(f"{rid}: KV of token {p} (block {ids[p // B]}) is {got[p, :2].tolist()}, "
                                         f"expected {[tokens[p], p]}")
            if self.state and new:
                from vllm_kvbm_plugin.connector.layout import STATE

                block = block_ids[self.groups[STATE][0]][(start - 1) // B]
                state = self.state[0][block].view(-1)[:2].tolist()
                want = [start, sum(tokens[:start]) % 65536]
                if state != want:
                    raise AssertionError(f"{rid}: state at {start} (block {block}) is {state}, expected {want}")
