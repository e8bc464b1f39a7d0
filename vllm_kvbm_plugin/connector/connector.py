"""KVBMConnector: vLLM's KV connector interface, delegating to the scheduler and worker sides."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from vllm_kvbm_plugin import config

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_kvbm_plugin.connector.metadata import KVBMMetadata
    from vllm_kvbm_plugin.connector.scheduler import SchedulerSide
    from vllm_kvbm_plugin.connector.stats import KVBMPromMetrics, KVBMStats
    from vllm_kvbm_plugin.connector.worker import WorkerSide


class KVBMConnector(KVConnectorBase_V1, SupportsHMA):
    """CPU, disk and remote KV tiers: vLLM's KV connector front door. Configure through
    `kv_connector_extra_config` (see config.KVBMConfig).

    vLLM builds one per process: in EngineCore with the scheduler role (it then owns a
    SchedulerSide: keys, tier bookkeeping, hit planning, events) and in each worker with the
    worker role (a WorkerSide: the CPU pool, copies, disk and remote I/O). Every vLLM hook is
    handed to the side this process owns. The model-dependent part of the config (which models
    position-independent loads serve, connector/pic_model.py) is settled here, once per process."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        if kv_cache_config is None:
            raise ValueError("KVBMConnector needs vLLM's KV cache config (vLLM >= 0.32 passes it)")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from vllm_kvbm_plugin.connector.layout import Layout
        from vllm_kvbm_plugin.connector.pic_model import PicModel, with_model_support

        cfg = with_model_support(config.connector_config(vllm_config), vllm_config)
        if cfg is None:
            raise ValueError(f"KVBMConnector is built, but kv_transfer_config names kv_connector "
                             f"{getattr(vllm_config.kv_transfer_config, 'kv_connector', None)!r}, "
                             f"not {config.CONNECTOR_NAME!r}")
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if cfg.pic_recompute_ratio and isinstance(cfg.pic_model, PicModel):
            from vllm_kvbm_plugin.patches import pic_blend

            pic_blend.check_parallel(vllm_config.parallel_config)  # in every process, before anything runs

        # raises for groups we cannot hold; only the scheduler side decides the tier secret (TierDecision)
        layout = Layout.from_vllm(vllm_config, kv_cache_config, cfg, decide=role == KVConnectorRole.SCHEDULER)
        if role == KVConnectorRole.SCHEDULER:
            from vllm_kvbm_plugin.connector.scheduler import SchedulerSide

            self._sched = SchedulerSide(layout, cfg)
        else:
            from vllm_kvbm_plugin.connector.worker import WorkerSide

            self._worker = WorkerSide(layout, cfg, _tensor_parallel_rank())
            if cfg.pic_recompute_ratio:  # layers after the selection run fewer rows
                from vllm_kvbm_plugin.patches import pic_blend

                pic_blend.apply_compute_saving(vllm_config)

    def _scheduler(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("KVBMConnector: a scheduler hook called on the worker side")
        return self._sched

    def _workers(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("KVBMConnector: a worker hook called on the scheduler side")
        return self._worker

    def _meta(self) -> KVBMMetadata | None:
        """This step's metadata, when it holds any work."""
        meta = self._get_connector_metadata()
        return meta if meta else None  # type: ignore[return-value]  # vLLM hands back what we built

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a lost load is a recompute, never a wrong token

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._workers().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta:
            self._workers().start_load_kv(meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved once per step, in wait_for_save

    def wait_for_save(self) -> None:
        # On CUDA a store's copy job returns with vLLM's stream ordered after the gather of its
        # blocks (tiers/transfer.py submit): that is the fence against a freed block being
        # rewritten while a store still reads it. bind_connector_metadata is too late for it:
        # the next step may rewrite a block before binding. Model runner V1
        # (v1/worker/gpu_model_runner.py execute_model) copies Mamba state in preprocess_mamba
        # (0.32 L4091, 0.33 L4057) before maybe_get_kv_connector_output binds (0.32 L4202,
        # 0.33 L4168); V2 (v1/worker/gpu/model_runner.py, the default where Triton is) runs
        # model_state.preprocess_state (0.32 L1820, 0.33 L1870) before kv_connector.pre_forward's
        # handle_preemptions and bind (0.32 L2003/L2028, 0.33 L2056/L2081). wait_for_save is the
        # last hook before all of them.
        meta = self._meta()
        if meta:
            self._workers().wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The requests whose asynchronous loads ran this step (hybrid hits with direct loads),
        failed ones in both sets: vLLM then recomputes them or fails them (kv_load_failure_policy)."""
        done, failed = self._workers().take_recving()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._workers().build_worker_meta()

    def get_kv_connector_stats(self) -> KVBMStats | None:
        """Worker side: transfers and the tiers' worker counters (e.g. the remote breaker's
        changes); scheduler side (vLLM adds it to the workers'): the tiers' own counters (e.g.
        the remote tier's hits, misses, errors) and the position-independent planner's computed
        and skipped tokens."""
        from vllm_kvbm_plugin.connector.stats import KVBMStats

        if self._worker is not None:
            stats, counts = self._worker.get_stats(), self._worker.take_tier_stats()
        else:
            stats, counts = None, self._scheduler().take_stats()
        if not counts:
            return stats
        return (stats or KVBMStats()).aggregate(KVBMStats(data=counts))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBMStats:
        from vllm_kvbm_plugin.connector.stats import KVBMStats

        return KVBMStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,  # type: ignore[override]  # vLLM's is generic in the metric kind
                           metric_types: dict[type[PromMetric], type[PromMetric]], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVBMPromMetrics:
        from vllm_kvbm_plugin.connector.stats import KVBMPromMetrics

        return KVBMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side --------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler().bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVBMMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().request_finished(request)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler().take_events()

    def has_pending_push_work(self) -> bool:
        """Keeps an engine core stepping while tier writes, fetches or worker reports are in
        flight (see SchedulerSide.has_pending_push_work); False on the worker side."""
        return self._sched is not None and self._sched.has_pending_push_work()


def _tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - not initialised in some harnesses
        return 0
