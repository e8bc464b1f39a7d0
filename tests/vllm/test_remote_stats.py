"""The remote tier's metrics: running totals become per-interval stats, and those become vLLM-style
Prometheus counters (the engine-level export is in tests/engine/test_remote_engine.py)."""

import collections
import types

from vllm_kvbm_plugin.connector.remote_scheduler import RemoteCounters
from vllm_kvbm_plugin.connector.stats import KVBMPromMetrics, KVBMStats
from vllm_kvbm_plugin.tiers.breaker import Breaker


def test_remote_totals_become_interval_stats_and_prometheus_counters(metric_types):
    tier = types.SimpleNamespace(counters=collections.Counter(lookup_keys=10, lookup_keys_found=4, fetched=4,
                                                              write_failures=2))
    breaker = Breaker("scheduler", "redis://x")
    breaker.failure(ConnectionError("down"))
    counters = RemoteCounters()
    first = counters.take(tier, breaker)
    assert first == {"remote_hits": 4, "remote_misses": 6, "remote_write_errors": 2,
                     "remote_scheduler_breaker_open": 1}
    assert counters.take(tier, breaker) == {}  # nothing new
    tier.counters["fetched"] += 3
    breaker.success()
    second = counters.take(tier, breaker)
    assert second == {"remote_hits": 3, "remote_scheduler_breaker_closed": 1}

    stats = KVBMStats(data=first).aggregate(KVBMStats(data=second))
    stats.record("remote", "read", 7, 7 << 14, 0.01)
    red = stats.reduce()
    assert red["remote_hits"] == 7 and red["remote_read_blocks"] == 7 and red["remote_write_errors"] == 2

    types_, registry = metric_types
    m = KVBMPromMetrics(type("C", (), {"kv_transfer_config": None})(), types_, ["engine"], {0: ["0"]})
    m.observe(stats.data)
    get = registry.get_sample_value
    assert get("vllm:kvbm_remote_hits_total", {"engine": "0"}) == 7
    assert get("vllm:kvbm_remote_misses_total", {"engine": "0"}) == 6
    assert get("vllm:kvbm_remote_errors_total", {"engine": "0", "operation": "write"}) == 2
    assert get("vllm:kvbm_bytes_total", {"engine": "0", "tier": "remote", "direction": "read"}) == 7 << 14
    for state in ("open", "closed"):
        assert get("vllm:kvbm_remote_breaker_changes_total", {"engine": "0", "side": "scheduler", "state": state}) == 1
