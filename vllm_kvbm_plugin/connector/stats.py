"""Tier transfer metrics in vLLM's connector-stats and Prometheus style.

Workers count blocks, bytes and seconds per (tier, direction), whatever the tier: cpu/store
(KV -> CPU slots), cpu/load (CPU slots -> KV), and each tier's own, e.g. disk/write, disk/read
(verified reads: prefetches into CPU slots and checks before a direct load), disk/load (disk -> KV
directly), remote/write, remote/read (verified GETs into CPU slots), plus each tier's failed
operations (`<tier>_<operation>_failures`). Each tier may count more on either side (`take_stats`
of its halves) and declare their Prometheus series (base.TierModule.series), as the remote tier
does for its lookups, errors and circuit-breaker changes. vLLM aggregates stats across workers, the scheduler
and steps (`aggregate`), logs `reduce()` with its "KV Transfer metrics" line, and feeds Prometheus
through `KVBMPromMetrics`:
    vllm:kvbm_blocks_total, vllm:kvbm_bytes_total, vllm:kvbm_transfer_seconds_total
        {tier, direction}
    vllm:kvbm_failures_total{tier, operation}
    the remote tier's (remote_scheduler.SERIES):
    vllm:kvbm_remote_hits_total     (blocks read from the server and verified)
    vllm:kvbm_remote_misses_total   (blocks looked up and not on the server)
    vllm:kvbm_remote_errors_total{operation}   (lookup, lookup_timeout, fetch, write)
    vllm:kvbm_remote_breaker_changes_total{side, state}   (scheduler / worker; open / closed)
    vllm:kvbm_pic_tokens_total{operation}   (position-independent loads, `kvbm-pic:` requests:
        loaded; of those, blended with a recompute; of those, recomputed (the selection kept their
        fresh KV); skipped (loaded past a gap: never computed); computed (served requests' prompt
        tokens without stored KV); the last two are counted on the scheduler side)
    vllm:kvbm_transfer_peak_bytes_per_second{tier, direction}   (gauge, with `measure_roofline`:
        this machine's peak for that transfer kind, tiers/roofline.py)
With `measure_roofline` the log line also gives each direction's speed as `<tier>_<direction>_pct_of_peak`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
)

from vllm_kvbm_plugin.connector.base import Series

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge
    from vllm.config import VllmConfig

FIELDS = ("blocks", "bytes", "seconds")
FAILURES = "_failures"  # stats key suffix of a tier's failed operations, e.g. disk_read_failures
# worker stats key of each position-independent-load token count -> its Prometheus label
PIC_TOKENS = {"pic_tokens": "loaded", "pic_blended_tokens": "blended", "pic_recomputed_tokens": "recomputed",
              "pic_computed_tokens": "computed", "pic_skipped_tokens": "skipped"}
PEAK = "peak_"  # stats key prefix of a measured peak (bytes/s), e.g. peak_disk_write
PIC_SERIES = Series("vllm:kvbm_pic_tokens_total",
                    "Tokens of kvbm-pic: requests loaded from other positions (loaded), of those loaded to be "
                    "blended with a selective recompute (blended), recomputed (selected), skipped by the prefill "
                    "(skipped); prompt tokens without stored KV (computed)",
                    {k: (operation,) for k, operation in PIC_TOKENS.items()}, ("operation",))


def directions(data: dict) -> list[tuple[str, str]]:
    """The (tier, direction) pairs with transfers in `data` (keys <tier>_<direction>_blocks; tier
    labels hold no "_"), in the order they were first recorded."""
    return [tuple(k[:-len("_blocks")].split("_", 1)) for k in data
            if k.endswith("_blocks") and not k.startswith(PEAK)]


@dataclasses.dataclass
class KVBMStats(KVConnectorStats):
    """One interval's counters of a KVBMConnector (blocks, bytes, seconds per tier and direction;
    failures; peaks; pic_* tokens). Workers fill it; vLLM aggregates it across workers in the engine
    core and hands it to the log line and KVBMPromMetrics."""

    def record(self, tier: str, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        for name, v in zip(FIELDS, (blocks, nbytes, seconds)):
            key = f"{tier}_{direction}_{name}"
            self.data[key] = self.data.get(key, 0) + v

    def peaks(self, peaks: dict[str, float]) -> None:
        """Carry the measured peaks (bytes/s per "<tier>_<direction>") with this interval's data."""
        for d, v in peaks.items():
            self.data[PEAK + d] = v

    def failure(self, tier: str, operation: str) -> None:
        key = f"{tier}_{operation}{FAILURES}"
        self.data[key] = self.data.get(key, 0) + 1

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVBMStats":
        for k, v in other.data.items():  # peaks are the same figure from every worker and step
            self.data[k] = max(self.data.get(k, 0), v) if k.startswith(PEAK) else self.data.get(k, 0) + v
        return self

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if not k.startswith(PEAK))

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for tier, direction in directions(self.data):
            p = f"{tier}_{direction}"
            blocks = self.data.get(f"{p}_blocks", 0)
            if blocks:
                secs = self.data.get(f"{p}_seconds", 0.0)
                out[f"{p}_blocks"] = blocks
                speed = self.data.get(f"{p}_bytes", 0) / max(secs, 1e-9)
                out[f"{p}_GiB_per_s"] = round(speed / 2**30, 2)
                if self.data.get(PEAK + p):
                    out[f"{p}_pct_of_peak"] = round(100 * speed / self.data[PEAK + p], 1)
        transfers = {f"{t}_{d}_{f}" for t, d in directions(self.data) for f in FIELDS}
        for k, v in self.data.items():  # failures and every tier's own counters, as they are named
            if v and k not in transfers and k not in PIC_TOKENS and not k.startswith(PEAK):
                out[k] = v
        for k, operation in PIC_TOKENS.items():
            if self.data.get(k):
                out[f"pic_{operation}_tokens"] = self.data[k]
        return out


class KVBMPromMetrics(KVConnectorPromMetrics):
    """The vllm:kvbm_* Prometheus series, built by vLLM's stat logger in the API server process
    from each interval's KVBMStats."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetric]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        extra = labelnames + ["tier", "direction"]
        # vLLM's class for each kind: prometheus_client's, or a stand-in that works alike (Ray)
        counter_cls, gauge_cls = cast("type[Counter]", self._counter_cls), cast("type[Gauge]", self._gauge_cls)
        self._counters = {
            "blocks": counter_cls(name="vllm:kvbm_blocks_total", labelnames=extra,
                                  documentation="KV blocks moved by the KVBM tiers"),
            "bytes": counter_cls(name="vllm:kvbm_bytes_total", labelnames=extra,
                                 documentation="Bytes moved by the KVBM tiers"),
            "seconds": counter_cls(name="vllm:kvbm_transfer_seconds_total", labelnames=extra,
                                   documentation="Seconds spent moving KV blocks by the KVBM tiers"),
        }
        self._failures = counter_cls(name="vllm:kvbm_failures_total",
                                     labelnames=labelnames + ["tier", "operation"],
                                     documentation="Tier reads (corrupt or missing), direct loads and writes "
                                                   "that failed")
        # the tiers' own series (base.TierModule.series) and the position-independent loads'
        self._series = [(series, counter_cls(name=series.name, labelnames=labelnames + list(series.labels),
                                             documentation=series.documentation))
                        for series in (*tier_series(vllm_config), PIC_SERIES)]
        self._peaks = gauge_cls(
            name="vllm:kvbm_transfer_peak_bytes_per_second", labelnames=extra, multiprocess_mode="mostrecent",
            documentation="This machine's peak for each KVBM transfer kind (measure_roofline): "
                          "rate(vllm:kvbm_bytes_total) / rate(vllm:kvbm_transfer_seconds_total) over it is the share")

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for tier, direction in directions(transfer_stats_data):
            for name, counter in self._counters.items():
                v = transfer_stats_data.get(f"{tier}_{direction}_{name}", 0)
                if v:
                    counter.labels(*labels, tier, direction).inc(v)
        for k, v in transfer_stats_data.items():
            if k.endswith(FAILURES) and v:
                tier, _, op = k[:-len(FAILURES)].partition("_")
                self._failures.labels(*labels, tier, op).inc(v)
        for series, counter in self._series:
            for k, values in series.keys.items():
                if v := transfer_stats_data.get(k, 0):
                    counter.labels(*labels, *values).inc(v)
        for k, v in transfer_stats_data.items():
            if k.startswith(PEAK) and v:
                tier, _, direction = k[len(PEAK):].partition("_")
                self._peaks.labels(*labels, tier, direction).set(v)


def tier_series(vllm_config: VllmConfig) -> list[Series]:
    """The Prometheus series of the configured tiers (the built-in ones without a config)."""
    from vllm_kvbm_plugin.config import connector_config
    from vllm_kvbm_plugin.connector.tier_modules import BUILT_IN, tier_modules

    cfg = connector_config(vllm_config) if getattr(vllm_config, "kv_transfer_config", None) else None
    return [s for m in (tier_modules(cfg) if cfg is not None else BUILT_IN) for s in m.series]
