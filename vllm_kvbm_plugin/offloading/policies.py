"""Our eviction policies as vLLM `CachePolicy` classes, for vLLM's own CPU offloading tier.

    "eviction_policy": "LineageCachePolicy",   # or "MultiLRUCachePolicy"
    "cache_policy_module_path": "vllm_kvbm_plugin.offloading",

The decisions are tiers/policies.py's (the same Lineage and MultiLRU objects KVBMConnector's tiers
use); this module only speaks vLLM's CachePolicy protocol (vllm/v1/kv_offload/cpu/policies/base.py):
it holds the ChunkStatus of each key, knows which chunks are busy (ref_cnt != 0: being stored or
loaded) and finds a stored chunk's parent from the request's key positions (lineage.py).

- LineageCachePolicy: least recently used among leaves; a chunk whose child is held is never
  evicted, so the CPU tier never keeps a suffix without its prefix.
- MultiLRUCachePolicy: frequency levels from a TinyLFU count-min sketch with decay. A store miss is
  one access, a reuse (a load, or a request finding the chunk already stored) another; eviction
  starts at the lowest level, and a store whose newcomers are colder than the chunks they would
  displace is refused (vLLM then skips that store), so one scan of cold blocks cannot flush a hot
  prefix.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import cast

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from vllm_kvbm_plugin.offloading.lineage import parent_in_request, parents_in_request
from vllm_kvbm_plugin.tiers.policies import EvictionPolicy, InEither, Lineage, MultiLRU


class _PolicyAdapter(CachePolicy):
    """A tiers.policies EvictionPolicy behind vLLM's CachePolicy protocol."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._busy: set[OffloadKey] = set()  # ref_cnt != 0: never a victim
        self._parents: dict[OffloadKey, OffloadKey | None] = {}  # of the last store miss's keys
        self.policy = self._new_policy()
        # vLLM's manager asks per key: the dict's own get, no Python frame per call
        self.get = self.chunks.get  # type: ignore[method-assign, assignment]

    def _new_policy(self) -> EvictionPolicy:
        raise NotImplementedError

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext | None = None) -> None:
        # vLLM 0.33 passes the storing request's context; 0.32 does not (on_store_miss told us)
        if key in self._parents:
            parent = self._parents.pop(key)
        else:
            parent = parent_in_request(key, req_context)
        self.chunks[key] = chunk
        if chunk.ref_cnt != 0:
            self._busy.add(key)
        self._add(key, parent)

    def _add(self, key: OffloadKey, parent: OffloadKey | None) -> None:
        self.policy.add(key, parent)

    def remove(self, key: OffloadKey) -> None:
        self.chunks.pop(key, None)
        self._busy.discard(key)
        self.policy.remove(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext | None = None) -> None:
        # head last, so a prefix's first chunk ends up the most recent (as vLLM's lru)
        for key in reversed(list(keys)):
            self.policy.touch(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext | None = None) -> None:
        """Called by vLLM right before the misses are inserted: note each one's parent."""
        self._parents = parents_in_request(keys, req_context)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        victims = self.policy.victims(n, InEither(self._busy, protected))
        if victims is None or not self._admit(victims):
            return None
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for key in cast("list[OffloadKey]", victims):  # the policy holds our keys
            out.append((key, self.chunks.pop(key)))
            self.policy.remove(key)
        return out

    def _admit(self, victims: list[Hashable]) -> bool:
        return True

    def clear(self) -> None:
        self.chunks.clear()
        self._busy.clear()
        self._parents.clear()
        self.policy = self._new_policy()

    def mark_evictable(self, key: OffloadKey) -> None:
        self._busy.discard(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._busy.add(key)


class LineageCachePolicy(_PolicyAdapter):
    """Leaf-first LRU: never evicts a chunk whose child is held (tiers.policies.Lineage)."""

    def _new_policy(self) -> EvictionPolicy:
        return Lineage()


class MultiLRUCachePolicy(_PolicyAdapter):
    """Frequency levels with TinyLFU admission (tiers.policies.MultiLRU)."""

    policy: MultiLRU

    def _new_policy(self) -> MultiLRU:
        return MultiLRU()

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext | None = None) -> None:
        listed = list(keys)
        super().on_store_miss(listed, req_context)
        for key in listed:
            self.policy.record_miss(key)  # the access that asks for the store

    def _add(self, key: OffloadKey, parent: OffloadKey | None) -> None:
        self.policy.add_counted(key)  # its store miss was the access

    def _admit(self, victims: list[Hashable]) -> bool:
        """Each newcomer (hottest first) against the victim it displaces (coldest first)."""
        incoming = [k for k in self._parents if k not in self.chunks]
        if not incoming:
            return True
        incoming.sort(key=self.policy.sketch.estimate, reverse=True)
        return all(self.policy.admit(incoming[min(i, len(incoming) - 1)], v) for i, v in enumerate(victims))

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext | None = None) -> None:
        """A reuse is an access; a chunk this request only inserted was counted at its miss."""
        for keys in key_groups:
            self.touch([k for k in keys if k in reused_keys], req_context)
