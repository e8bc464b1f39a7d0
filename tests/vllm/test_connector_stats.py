"""Tier metrics: vLLM's stats aggregation contract and real Prometheus counters."""

from vllm_kvbm_plugin.connector import KVBMConnector
from vllm_kvbm_plugin.connector.stats import KVBMPromMetrics, KVBMStats


def test_stats_aggregate_reduce_and_reset():
    a = KVBMStats()
    a.record("cpu", "load", 4, 4 << 20, 0.002)
    b = KVBMConnector.build_kv_connector_stats({"cpu_load_blocks": 2, "cpu_load_bytes": 2 << 20,
                                                "cpu_load_seconds": 0.001, "disk_read_failures": 1})
    s = a.aggregate(b)
    assert s.data["cpu_load_blocks"] == 6 and not s.is_empty()
    red = s.reduce()
    assert red["cpu_load_blocks"] == 6 and abs(red["cpu_load_GiB_per_s"] - 1.95) < 0.01
    assert red["disk_read_failures"] == 1
    assert "pic_loaded_tokens" not in red  # no position-independent loads: nothing said
    s.aggregate(KVBMStats(data={"pic_tokens": 96, "pic_blended_tokens": 64, "pic_recomputed_tokens": 9}))
    s.aggregate(KVBMStats(data={"pic_computed_tokens": 55, "pic_skipped_tokens": 32}))  # the scheduler's
    red = s.reduce()
    assert (red["pic_loaded_tokens"], red["pic_blended_tokens"], red["pic_recomputed_tokens"]) == (96, 64, 9)
    assert (red["pic_computed_tokens"], red["pic_skipped_tokens"]) == (55, 32)
    s.reset()
    assert s.is_empty()


def test_prometheus_counters(metric_types):
    types, registry = metric_types
    cfg = type("C", (), {"kv_transfer_config": None})()
    m = KVBMPromMetrics(cfg, types, ["engine"], {0: ["0"]})
    m.observe({"disk_write_blocks": 3, "disk_write_bytes": 300, "disk_write_seconds": 0.5,
               "disk_read_failures": 2, "pic_tokens": 96, "pic_recomputed_tokens": 9,
               "pic_computed_tokens": 55, "pic_skipped_tokens": 32})
    get = registry.get_sample_value
    assert get("vllm:kvbm_blocks_total", {"engine": "0", "tier": "disk", "direction": "write"}) == 3
    assert get("vllm:kvbm_bytes_total", {"engine": "0", "tier": "disk", "direction": "write"}) == 300
    assert get("vllm:kvbm_failures_total", {"engine": "0", "tier": "disk", "operation": "read"}) == 2
    assert get("vllm:kvbm_pic_tokens_total", {"engine": "0", "operation": "loaded"}) == 96
    assert get("vllm:kvbm_pic_tokens_total", {"engine": "0", "operation": "recomputed"}) == 9
    assert get("vllm:kvbm_pic_tokens_total", {"engine": "0", "operation": "blended"}) is None
    assert get("vllm:kvbm_pic_tokens_total", {"engine": "0", "operation": "computed"}) == 55
    assert get("vllm:kvbm_pic_tokens_total", {"engine": "0", "operation": "skipped"}) == 32


def test_measured_peaks_ride_with_the_stats_and_set_a_gauge(metric_types):
    """measure_roofline: every worker's stats carry the same peaks; aggregated they stay the peak
    (not a sum), the log line gives the share reached, and Prometheus gets a gauge."""
    workers = []
    for _ in range(2):
        s = KVBMStats()
        s.record("disk", "write", 4, 1 << 30, 1.0)  # 1 GiB/s
        s.peaks({"disk_write": 4 * 2**30, "cpu_store": 20 * 2**30})
        workers.append(s)
    total = workers[0].aggregate(workers[1])
    red = total.reduce()
    assert red["disk_write_GiB_per_s"] == 1.0 and red["disk_write_pct_of_peak"] == 25.0
    assert "cpu_store_pct_of_peak" not in red  # nothing stored to the CPU tier in this interval
    assert KVBMStats(data={"peak_disk_write": 1.0}).is_empty()  # peaks alone are no news
    types, registry = metric_types
    m = KVBMPromMetrics(type("C", (), {"kv_transfer_config": None})(), types, ["engine"], {0: ["0"]})
    m.observe(total.data)
    peak = registry.get_sample_value("vllm:kvbm_transfer_peak_bytes_per_second",
                                     {"engine": "0", "tier": "disk", "direction": "write"})
    assert peak == 4 * 2**30
