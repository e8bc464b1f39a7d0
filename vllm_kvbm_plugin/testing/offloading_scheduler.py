"""vLLM's own OffloadingConnector inside vLLM's real Scheduler, in-process, without a model
(vLLM 0.32 and 0.33): the path GPU users take with our spec, policies and tiers.

The KV cache is planned as vLLM's engine core plans it (compat.plan_kv_cache: groups, pages padded
to one size, every group's tensor over the same bytes) and allocated with vLLM's allocator; a
hybrid config has Mamba-style state layers (align mode) besides an attention layer, as tiny
Qwen3-Next / Granite-4-H / Nemotron-H give. The worker is vLLM's own OffloadingConnector worker
role, called in the model runner's order, with the spec's worker doing the copies (our
KVBMCPUWorker: vLLM's CPU spec has none on the CPU platform, so ours stands in for it there).
A stand-in forward writes every computed token's id and position into its attention slot and
the recurrent state (its position, the sum of the tokens before it, the layer) into the state
page of the step's last token; before each forward `OffloadingWorkerStandIn.check` compares every
attention block and the state page a scheduled request resumes from with what that forward wrote:
a tier load of wrong bytes, into the wrong block or group, fails the step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.outputs import KVConnectorOutput

from vllm_kvbm_plugin import compat
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness, Spans

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_offload.base import OffloadingManager

SPEC_MODULE = "vllm_kvbm_plugin.offloading"


@dataclasses.dataclass
class OffloadingHarnessConfig(HarnessConfig):
    """HarnessConfig for vLLM's OffloadingConnector: `offloading` is its kv_connector_extra_config
    (cpu_bytes_to_use, disk_path, secondary_tiers, eviction_policy, ...); `kvbm_spec` picks
    KVBMOffloadingSpec (else vLLM's default CPUOffloadingSpec). Hybrid: `mamba_layers` state
    layers (one group each) and one attention layer; dense: two attention layers in one group."""

    offloading: dict[str, Any] = dataclasses.field(default_factory=dict)
    kvbm_spec: bool = True
    mamba_layers: int = 2
    block_size: int = 64
    hash_block_size: int | None = 16
    num_blocks: int = 128
    max_model_len: int = 1024
    max_num_batched_tokens: int = 512
    oracle: bool = True  # the stand-in forward and its checks (benchmarks that time the scheduler skip them)


class OffloadingHarness(SchedulerHarness):
    """SchedulerHarness with vLLM's OffloadingConnector as the scheduler's connector and one
    OffloadingWorkerStandIn (module docstring). Call `close()` when done: it removes the primary
    tier's shared memory."""

    cfg: OffloadingHarnessConfig
    workers: list[OffloadingWorkerStandIn]  # type: ignore[assignment]  # its own, driven by its own steps

    def __init__(self, cfg: OffloadingHarnessConfig) -> None:
        # what the plugin applies in every engine process: our patch of vLLM's offloading events
        # (inert for vLLM's own spec), so benchmarks time what users run
        from vllm_kvbm_plugin.patches import offload_events

        offload_events.apply()
        super().__init__(cfg)

    def _kv_transfer_config(self) -> KVTransferConfig:
        extra = dict(self.cfg.offloading)
        if self.cfg.kvbm_spec:
            extra.setdefault("spec_name", "KVBMOffloadingSpec")
            extra.setdefault("spec_module_path", SPEC_MODULE)
        return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config=extra)

    def _kv_cache_config(self) -> tuple[KVCacheConfig, int, int]:
        cfg, bs = self.cfg, self.cfg.block_size
        # the layout the engine core resolves for OffloadingConnector (its required layout)
        self.vllm_config.cache_config.kv_cache_layout = "LBHNC"
        specs: dict[str, KVCacheSpec] = {}
        if cfg.hybrid:
            for i in range(cfg.mamba_layers):
                specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                    block_size=bs, shapes=((2, 8), (2, 4, 4)), dtypes=(torch.float32, torch.float32),
                    mamba_cache_mode="align")
            attention = [f"model.layers.{cfg.mamba_layers}.self_attn.attn"]
        else:
            attention = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
        for name in attention:
            specs[name] = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=16, dtype=torch.float32)
        page = specs[attention[0]].page_size_bytes
        worker, sched, sched_bs, hbs = compat.plan_kv_cache(self.vllm_config, specs,
                                                           cfg.num_blocks * page * len(attention))
        self.worker_kv_cache_config = worker
        return sched, sched_bs, hbs

    def _workers(self, kv_cache_config: KVCacheConfig) -> list[OffloadingWorkerStandIn]:  # type: ignore[override]
        self.preempted = 0  # requests vLLM preempted so far
        return [OffloadingWorkerStandIn(self.vllm_config, self.worker_kv_cache_config, self.cfg.oracle)]

    def _run_workers(self, out: SchedulerOutput, rids: list[str]) -> KVConnectorOutput:
        self.preempted += len(out.preempted_req_ids or ())
        return self.workers[0].run_step(out, self._spans(out, rids))

    @property
    def _connector(self) -> OffloadingConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        return connector

    @property
    def offloading(self) -> OffloadingConnectorScheduler:
        """vLLM's OffloadingConnectorScheduler."""
        return self._connector.scheduler

    @property
    def manager(self) -> OffloadingManager:
        """The spec's OffloadingManager (vLLM's tiering manager with KVBMOffloadingSpec)."""
        return self.offloading.manager

    def run(self, timeout: float | None = None) -> None:
        """Step until every request finished, yielding a moment after a step without a forward
        (as vLLM's engine core does): secondary tiers promote hits in background threads."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.scheduler.has_unfinished_requests():
            if not self.step():
                time.sleep(0.001)
            assert deadline is None or time.monotonic() < deadline, "requests did not finish"

    def settle(self, timeout: float = 30.0) -> None:
        """Step until the connector has no transfer or tier write in flight (stores are submitted
        a step late, secondary tiers write in the background)."""
        deadline = time.monotonic() + timeout
        self.step()
        while self._connector.has_pending_push_work() or self._tiers_busy():
            assert time.monotonic() < deadline, "offloading work did not settle"
            self.step()
            time.sleep(0.002)

    def _tiers_busy(self) -> bool:
        busy = getattr(self.manager, "has_pending_work", None)
        return bool(busy and busy())

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=False): the GPU prefix cache only."""
        ok = self.scheduler.reset_prefix_cache()
        self.step()
        return ok

    def reset_tiers(self) -> None:
        """Drop the CPU primary tier as the connector's reset_cache does (secondary tiers keep
        their entries and promote hits back)."""
        self._connector.reset_cache()
        self.settle()

    def close(self) -> None:
        self.workers[0].connector.shutdown()
        self._connector.shutdown()


class OffloadingWorkerStandIn:
    """vLLM's OffloadingConnector in its worker role over the KV tensors vLLM's allocator gives
    this harness's KV cache config, driven like the model runner drives it, with a stand-in
    forward and the KV oracle `check` (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, oracle: bool = True) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.worker.utils import allocate_kv_cache

        from vllm_kvbm_plugin.offloading.spec import KVBMOffloadingSpec, cpu_platform_worker

        self.num_blocks = kv_cache_config.num_blocks
        self.oracle = oracle
        self.kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"),
                                           vllm_config.cache_config.get_resolved_kv_cache_layout())
        # (group index, float32 view) per layer
        self.attention: list[tuple[int, torch.Tensor]] = []
        self.state: list[tuple[int, torch.Tensor]] = []
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                t = self.kv_caches[name]
                if isinstance(group.kv_cache_spec, MambaSpec):
                    self.state.append((g, t.view(torch.float32).view(t.shape[0], -1)))  # a view, never a copy
                else:
                    assert t.dtype == torch.float32 and t.dim() == 4  # (blocks, heads, tokens, 2 x head size)
                    self.attention.append((g, t))
        self.block_size = {g: group.kv_cache_spec.block_size for g, group in enumerate(kv_cache_config.kv_cache_groups)}
        self.loaded = [0] * len(kv_cache_config.kv_cache_groups)  # KV blocks loaded, per offloaded group
        self.connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        worker = self.connector.connector_worker
        assert worker is not None
        if not isinstance(worker.spec, KVBMOffloadingSpec):
            # vLLM's CPU spec refuses a worker on the CPU platform: ours copies into its region
            spec: Any = worker.spec  # a CPUOffloadingSpec (its primary tier's attributes)
            spec.get_worker = lambda kv: cpu_platform_worker(spec, kv)
        self.connector.register_kv_caches(self.kv_caches)

    def run_step(self, out: SchedulerOutput, spans: Spans) -> KVConnectorOutput:
        """One step in the model runner's order: preemption flushes, zeroed new blocks and
        copy-on-write copies, the connector's loads (sync ones before the forward, the rest
        after it), the forward, the connector's stores (queued for the next step)."""
        from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

        c = self.connector
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)  # the OffloadingConnector's scheduler side's
        c.handle_preemptions(meta)
        if out.new_block_ids_to_zero:
            ids = torch.tensor(out.new_block_ids_to_zero)
            for t in self.kv_caches.values():
                t[ids] = 0
        copy_kv_cache_blocks_inplace(self.kv_caches.values(), self.num_blocks,
                                     getattr(out, "kv_cache_block_copies", None) or ())
        for job in meta.load_jobs.values():
            assert isinstance(job.dst_spec, GPULoadStoreSpec)  # a load lands in the KV cache
            for g, n in enumerate(job.dst_spec.group_sizes):
                self.loaded[g] += n
        c.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            c.start_load_kv(None)  # type: ignore[arg-type]  # the OffloadingConnector reads no forward context
        if self.oracle:
            self.check(spans)
            for tokens, start, end, block_ids, _new in spans.values():
                self._forward(tokens, start, end, block_ids)
        if not out.has_sync_kv_loads:
            c.start_load_kv(None)  # type: ignore[arg-type]
        c.wait_for_save()
        results = c.get_transfer_results(out.finished_req_ids)
        output = KVConnectorOutput(finished_sending=results.finished_sending,
                                   finished_recving=results.finished_recving,
                                   failed_recving=results.failed_recving,
                                   kv_connector_worker_meta=c.build_connector_worker_meta())
        c.clear_connector_metadata()
        return output

    @staticmethod
    def _state(tokens: Sequence[int], end: int, layer: int) -> list[float]:
        return [float(end), float(sum(tokens[:end]) % 65536), float(layer + 1)]

    def _forward(self, tokens: Sequence[int], start: int, end: int, block_ids: tuple[list[int], ...]) -> None:
        for g, t in self.attention:
            B, ids = self.block_size[g], block_ids[g]
            pos = torch.arange(start, end)
            blocks = torch.tensor([ids[p // B] for p in range(start, end)])
            t[blocks, :, pos % B, 0] = torch.tensor(tokens[start:end], dtype=torch.float32)[:, None]
            t[blocks, :, pos % B, 1] = pos.to(torch.float32)[:, None]
        for layer, (g, t) in enumerate(self.state):
            block = block_ids[g][(end - 1) // self.block_size[g]]
            t[block, :3] = torch.tensor(self._state(tokens, end, layer))

    def check(self, spans: Spans) -> None:
        """Before the forward: every token a scheduled request already has (computed before, hit
        in vLLM's prefix cache or loaded from a tier) sits in its attention block with its id and
        position, and every state layer's page the request resumes from holds the state at its
        first position to compute."""
        for rid, (tokens, start, _end, block_ids, _new) in spans.items():
            if start == 0:
                continue
            for g, t in self.attention:
                B, ids = self.block_size[g], block_ids[g]
                pos = torch.arange(start)
                blocks = torch.tensor([ids[p // B] for p in range(start)])
                got = t[blocks, :, pos % B, :2]  # (tokens, heads, 2)
                want = torch.stack([torch.tensor(tokens[:start], dtype=torch.float32), pos.to(torch.float32)], 1)
                bad = (got != want[:, None, :]).any(-1).any(-1).nonzero()
                if len(bad):
                    p = int(bad[0])
                    raise AssertionError(f"{rid}: KV of token {p} (group {g} block {ids[p // B]}) is "
                                         f"{got[p, 0].tolist()}, expected {[tokens[p], p]}")
            for layer, (g, t) in enumerate(self.state):
                block = block_ids[g][(start - 1) // self.block_size[g]]
                state, expected = t[block, :3].tolist(), self._state(tokens, start, layer)
                if state != expected:
                    raise AssertionError(f"{rid}: state layer {layer} at {start} (group {g} block {block}) "
                                         f"is {state}, expected {expected}")
