"""Driving vLLM's own offloading managers in-process, call for call as its OffloadingConnector's
scheduler side does (offloading/scheduler.py): for tests and benchmarks, no engine needed.

A request is a list of offload keys, one per chunk of one KV cache group, with the end-token
positions the connector records; `store` and `load` run a manager's verbs on them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec, LookupResult, OffloadingManager, OffloadKey, PrepareStoreOutput, ReqContext, ScheduleEndContext,
    make_offload_key)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingEvent
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

Fill = Callable[[list[int], list[OffloadKey]], object]  # the worker's copy of chunks (ids, keys)


def chunk_key(name: str, group: int = 0) -> OffloadKey:
    """A made-up OffloadKey: a 32-byte block hash (as vLLM's sha256 hashes) of `name`."""
    return make_offload_key(hashlib.sha256(name.encode()).digest(), group)


class Request:
    """One request's ReqContext with its keys' positions (`tokens_per_chunk` apart)."""

    _ids = 0

    def __init__(self, manager: OffloadingManager, keys: list[OffloadKey], tokens_per_chunk: int = 16) -> None:
        Request._ids += 1
        self.manager = manager
        self.keys = keys
        self.ctx = ReqContext(req_id=f"req-{Request._ids}")
        for i, key in enumerate(keys):
            self.ctx.set_offload_key_position(key, (i + 1) * tokens_per_chunk)
        manager.on_new_request(self.ctx)

    def store(self, keys: list[OffloadKey] | None = None, fill: Fill | None = None,
              success: bool = True) -> PrepareStoreOutput | None:
        """prepare_store + (the worker's copy: fill(chunk_ids, keys)) + complete_store. Returns the
        PrepareStoreOutput (None: refused)."""
        keys = self.keys if keys is None else keys
        out = self.manager.prepare_store(keys, self.ctx)
        if out is None or not out.keys_to_store:
            return out
        if fill is not None:
            assert isinstance(out.store_spec, BlockIDsLoadStoreSpec)  # the CPU tier's chunks
            fill(list(out.store_spec.block_ids), list(out.keys_to_store))
        self.manager.complete_store(out.keys_to_store, self.ctx, success)
        return out

    def lookup(self, keys: list[OffloadKey] | None = None) -> list[LookupResult]:
        return [self.manager.lookup(k, self.ctx) for k in (self.keys if keys is None else keys)]

    def load(self, keys: list[OffloadKey], read: Fill | None = None) -> None:
        """prepare_load + (the worker's copy: read(chunk_ids, keys)) + complete_load."""
        spec = self.manager.prepare_load(keys, self.ctx)
        if read is not None:
            assert isinstance(spec, BlockIDsLoadStoreSpec)  # the CPU tier's chunks
            read(list(spec.block_ids), list(keys))
        self.manager.complete_load(keys, self.ctx)

    def finish(self) -> None:
        self.manager.on_request_finished(self.ctx)


def end_step(manager: OffloadingManager) -> None:
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def lookup_until_settled(manager: OffloadingManager, req: Request, keys: list[OffloadKey], timeout: float = 10.0) -> list[LookupResult]:
    """Look `keys` up step after step, as the connector does while a tier promotes them, until
    no answer is pending (HIT_PENDING / RETRY)."""
    deadline = time.monotonic() + timeout
    while True:
        results = req.lookup(keys)
        if not any(r in (LookupResult.HIT_PENDING, LookupResult.RETRY) for r in results):
            return results
        if time.monotonic() > deadline:
            raise TimeoutError(f"lookups still pending after {timeout} s: {results}")
        end_step(manager)
        time.sleep(0.002)


def offloading_config(extra_config: dict, chunk_bytes: int = 4096, tokens_per_block: int = 16,
                      engine_id: str = "kvbm-test", events: bool = True, model: str = "tiny-test",
                      blocks_per_chunk: int = 1) -> OffloadingConfig:
    """vLLM's OffloadingConfig for one full-attention group on one worker, chunks of
    `blocks_per_chunk` blocks of `chunk_bytes` (the same constructor on 0.32 and 0.33: 0.33's new
    fields have defaults)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig, OffloadingModelConfig,
        OffloadingParallelConfig)

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=tokens_per_block, layer_names=("layers.0",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )


def tiering_manager(secondary_tiers: list, cpu_chunks: int, chunk_bytes: int = 4096, eviction_policy: str = "lru",
                    engine_id: str = "kvbm-test", events: bool = True,
                    **extra: object) -> tuple[TieringOffloadingSpec, TieringOffloadingManager]:
    """(spec, manager): vLLM's TieringOffloadingSpec and its TieringOffloadingManager (a CPU
    primary tier of `cpu_chunks` chunks in shared memory, then `secondary_tiers`). Call
    manager.shutdown() when done (it removes the shared-memory file)."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    extra_config = {"cpu_bytes_to_use": cpu_chunks * chunk_bytes, "eviction_policy": eviction_policy,
                    "secondary_tiers": [dict(t) for t in secondary_tiers], **extra}
    if eviction_policy not in ("lru", "arc"):
        extra_config["cache_policy_module_path"] = "vllm_kvbm_plugin.offloading"
    spec = TieringOffloadingSpec(offloading_config(extra_config, chunk_bytes, engine_id=engine_id, events=events))
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    return spec, manager


def primary_rows(manager: TieringOffloadingManager) -> np.ndarray:
    """The CPU primary tier's chunks as a (chunks, bytes) uint8 array (vLLM's shared memory)."""
    view = manager.primary_tier.get_kv_memoryview()
    rows = np.asarray(view)
    return rows.view(np.uint8).reshape(rows.shape[0], -1)


def payload(key: bytes, size: int = 4096) -> np.ndarray:
    """Made-up chunk bytes of `key` (the same every time)."""
    return np.random.default_rng(int.from_bytes(key[:8], "big")).integers(0, 256, size, dtype=np.uint8)


class Tiered:
    """vLLM's tiering manager with one secondary tier (`tier`: its secondary_tiers entry), and the
    calls the connector makes: `store` cascades through the CPU primary tier, `load` promotes hits."""

    def __init__(self, tier: dict, cpu_chunks: int = 8, chunk_bytes: int = 4096, cpu_policy: str = "lru") -> None:
        import uuid

        self.chunk_bytes = chunk_bytes
        self.spec, self.m = tiering_manager([tier], cpu_chunks, chunk_bytes, cpu_policy,
                                            engine_id=f"kvbm-test-{uuid.uuid4().hex[:8]}")
        self.tier = self.m.secondary_tiers[0]
        self.rows = primary_rows(self.m)
        self.events: list[OffloadingEvent] = []

    def settle(self) -> None:
        for _ in range(2000):
            end_step(self.m)
            if not self.m.has_pending_work():
                break
            time.sleep(0.002)
        self.events += list(self.m.take_events())

    def store(self, keys: list, per_step: int | None = None) -> None:
        """One request stores `keys` (per_step at a time) into the CPU tier, which cascades them."""
        r = Request(self.m, keys)
        fill = lambda cids, ks: [self.rows.__setitem__(c, payload(k, self.chunk_bytes)) for c, k in zip(cids, ks)]  # noqa: E731
        step = per_step or len(keys)
        for i in range(0, len(keys), step):
            r.store(keys[i: i + step], fill=fill)
            self.settle()
        r.finish()
        self.settle()

    def load(self, keys: list) -> dict:
        """Drop the CPU tier, then look `keys` up (promoting the secondary tier's hits) and load the
        prefix that hits, as the connector would: key -> bytes served, or None for a miss."""
        from vllm_kvbm_plugin import compat

        compat.reset_offloading_cache(self.m)
        r = Request(self.m, keys)
        results = lookup_until_settled(self.m, r, keys)
        served = {}
        hits = [k for k, res in zip(keys, results) if res is LookupResult.HIT]
        if hits:
            r.load(hits, read=lambda cids, ks: served.update({k: self.rows[c].copy() for c, k in zip(cids, ks)}))
        r.finish()
        self.settle()
        return {k: served.get(k) for k in keys}

    def storage_events(self, removed: bool) -> list:
        from vllm.v1.kv_offload.base import Medium

        return [k for e in self.events if e.medium is Medium.STORAGE and e.removed == removed for k in e.keys]

    def close(self) -> None:
        del self.rows  # vLLM's shared memory, which shutdown closes
        self.m.shutdown()
