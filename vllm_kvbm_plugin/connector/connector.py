"""KVBMConnector: vLLM's KV connector interface, delegating to the scheduler and worker sides."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from vllm_kvbm_plugin import config


class KVBMConnector(KVConnectorBase_V1, SupportsHMA):
    """CPU, disk and remote KV tiers: vLLM's KV connector front door. Configure through
    `kv_connector_extra_config` (see config.KVBMConfig).

    vLLM builds one per process: in EngineCore with the scheduler role (it then owns a
    SchedulerSide: keys, tier bookkeeping, hit planning, events) and in each worker with the
    worker role (a WorkerSide: the CPU pool, copies, disk and remote I/O). Every vLLM hook is
    handed to the side this process owns. The model-dependent part of the config (which models
    position-independent loads serve, connector/pic_model.py) is settled here, once per process."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from vllm_kvbm_plugin.connector.layout import Layout
        from vllm_kvbm_plugin.connector.pic_model import PicModel, with_model_support

        cfg = with_model_support(config.connector_config(vllm_config), vllm_config)
        self._sched = self._worker = None
        if getattr(cfg, "pic_recompute_ratio", 0) and isinstance(cfg.pic_model, PicModel):
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
            if getattr(cfg, "pic_recompute_ratio", 0):  # layers after the selection run fewer rows
                from vllm_kvbm_plugin.patches import pic_blend

                pic_blend.apply_compute_saving(vllm_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a lost load is a recompute, never a wrong token

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if meta:
            self._worker.start_load_kv(meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv before the forward

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
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
        meta = self._get_connector_metadata()
        if meta:
            self._worker.wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The requests whose asynchronous loads ran this step (hybrid hits with direct loads),
        failed ones in both sets: vLLM then recomputes them or fails them (kv_load_failure_policy)."""
        done, failed = self._worker.take_recving()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta()

    def get_kv_connector_stats(self):
        """Worker side: transfers and the tiers' worker counters (e.g. the remote breaker's
        changes); scheduler side (vLLM adds it to the workers'): the tiers' own counters (e.g.
        the remote tier's hits, misses, errors) and the position-independent planner's computed
        and skipped tokens."""
        from vllm_kvbm_plugin.connector.stats import KVBMStats

        if self._worker is not None:
            stats, counts = self._worker.get_stats(), self._worker.take_tier_stats()
        else:
            stats, counts = None, self._sched.take_stats()
        if not counts:
            return stats
        return (stats or KVBMStats()).aggregate(KVBMStats(data=counts))

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        from vllm_kvbm_plugin.connector.stats import KVBMStats

        return KVBMStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from vllm_kvbm_plugin.connector.stats import KVBMPromMetrics

        return KVBMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side --------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched.bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        self._sched.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        self._sched.request_finished(request)
        return False, None

    def take_events(self):
        return self._sched.take_events()

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
