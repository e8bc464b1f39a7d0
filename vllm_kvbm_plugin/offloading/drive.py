"""Driving vLLM's own offloading managers in-process, call for call as its OffloadingConnector's
scheduler side does (offloading/scheduler.py): for tests and benchmarks, no engine needed.

A request is a list of offload keys, one per chunk of one KV cache group, with the end-token
positions the connector records; `store` and `load` run a manager's verbs on them.
"""

from __future__ import annotations

import hashlib
import time

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key


def chunk_key(name: str, group: int = 0) -> bytes:
    """A made-up OffloadKey: a 32-byte block hash (as vLLM's sha256 hashes) of `name`."""
    return make_offload_key(hashlib.sha256(name.encode()).digest(), group)


class Request:
    """One request's ReqContext with its keys' positions (`tokens_per_chunk` apart)."""

    _ids = 0

    def __init__(self, manager, keys: list[bytes], tokens_per_chunk: int = 16):
        Request._ids += 1
        self.manager = manager
        self.keys = keys
        self.ctx = ReqContext(req_id=f"req-{Request._ids}")
        for i, key in enumerate(keys):
            self.ctx.set_offload_key_position(key, (i + 1) * tokens_per_chunk)
        manager.on_new_request(self.ctx)

    def store(self, keys: list[bytes] | None = None, fill=None, success: bool = True):
        """prepare_store + (the worker's copy: fill(chunk_ids, keys)) + complete_store. Returns the
        PrepareStoreOutput (None: refused)."""
        keys = self.keys if keys is None else keys
        out = self.manager.prepare_store(keys, self.ctx)
        if out is None or not out.keys_to_store:
            return out
        if fill is not None:
            fill(list(out.store_spec.block_ids), list(out.keys_to_store))
        self.manager.complete_store(out.keys_to_store, self.ctx, success)
        return out

    def lookup(self, keys: list[bytes] | None = None) -> list[LookupResult]:
        return [self.manager.lookup(k, self.ctx) for k in (self.keys if keys is None else keys)]

    def load(self, keys: list[bytes], read=None) -> None:
        """prepare_load + (the worker's copy: read(chunk_ids, keys)) + complete_load."""
        spec = self.manager.prepare_load(keys, self.ctx)
        if read is not None:
            read(list(spec.block_ids), list(keys))
        self.manager.complete_load(keys, self.ctx)

    def finish(self) -> None:
        self.manager.on_request_finished(self.ctx)


def end_step(manager) -> None:
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def lookup_until_settled(manager, req: Request, keys: list[bytes], timeout: float = 10.0) -> list[LookupResult]:
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
