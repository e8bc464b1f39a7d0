"""Tier transfer metrics in vLLM's connector-stats and Prometheus style.

Workers count blocks, bytes and seconds per (tier, direction): cpu/store (KV -> CPU slots),
cpu/load (CPU slots -> KV), disk/write, disk/read (verified reads: prefetches into CPU slots and
checks before a direct load), disk/load (disk -> KV directly), plus failed disk reads and writes. vLLM aggregates them across workers and steps (`aggregate`), logs `reduce()` with its
"KV Transfer metrics" line, and feeds Prometheus through `KVBMPromMetrics`:
    vllm:kvbm_blocks_total, vllm:kvbm_bytes_total, vllm:kvbm_transfer_seconds_total
        {tier, direction}
    vllm:kvbm_disk_failures_total{operation}
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

DIRECTIONS = (("cpu", "store"), ("cpu", "load"), ("disk", "write"), ("disk", "read"), ("disk", "load"))
FIELDS = ("blocks", "bytes", "seconds")


@dataclasses.dataclass
class KVBMStats(KVConnectorStats):
    def record(self, tier: str, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        for name, v in zip(FIELDS, (blocks, nbytes, seconds)):
            key = f"{tier}_{direction}_{name}"
            self.data[key] = self.data.get(key, 0) + v

    def failure(self, operation: str) -> None:
        key = f"disk_{operation}_failures"
        self.data[key] = self.data.get(key, 0) + 1

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVBMStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for tier, direction in DIRECTIONS:
            p = f"{tier}_{direction}"
            blocks = self.data.get(f"{p}_blocks", 0)
            if blocks:
                secs = self.data.get(f"{p}_seconds", 0.0)
                out[f"{p}_blocks"] = blocks
                out[f"{p}_GiB_per_s"] = round(self.data.get(f"{p}_bytes", 0) / max(secs, 1e-9) / 2**30, 2)
        for op in ("read", "write"):
            if self.data.get(f"disk_{op}_failures"):
                out[f"disk_{op}_failures"] = self.data[f"disk_{op}_failures"]
        return out


class KVBMPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        extra = labelnames + ["tier", "direction"]
        self._counters = {
            "blocks": self._counter_cls(name="vllm:kvbm_blocks_total", labelnames=extra,
                                        documentation="KV blocks moved by the KVBM tiers"),
            "bytes": self._counter_cls(name="vllm:kvbm_bytes_total", labelnames=extra,
                                       documentation="Bytes moved by the KVBM tiers"),
            "seconds": self._counter_cls(name="vllm:kvbm_transfer_seconds_total", labelnames=extra,
                                         documentation="Seconds spent moving KV blocks by the KVBM tiers"),
        }
        self._failures = self._counter_cls(name="vllm:kvbm_disk_failures_total",
                                           labelnames=labelnames + ["operation"],
                                           documentation="Disk tier reads (corrupt or missing) and writes that failed")

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for tier, direction in DIRECTIONS:
            for name, counter in self._counters.items():
                v = transfer_stats_data.get(f"{tier}_{direction}_{name}", 0)
                if v:
                    counter.labels(*labels, tier, direction).inc(v)
        for op in ("read", "write"):
            v = transfer_stats_data.get(f"disk_{op}_failures", 0)
            if v:
                self._failures.labels(*labels, op).inc(v)
