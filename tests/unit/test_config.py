import types

import pytest

from vllm_kvbm_plugin import config


def vllm_config(extra, name="KVBMConnector"):
    ktc = types.SimpleNamespace(kv_connector=name, kv_connector_extra_config=extra)
    return types.SimpleNamespace(kv_transfer_config=ktc)


def test_unknown_connector_key_names_the_valid_ones():
    with pytest.raises(ValueError, match="hash_block_sise.*valid keys: cpu_bytes_to_use, disk_path"):
        config.connector_config(vllm_config({"hash_block_sise": 32}))


def test_bad_values_and_other_connectors():
    with pytest.raises(ValueError, match="positive integer"):
        config.connector_config(vllm_config({"hash_block_size": 0}))
    with pytest.raises(ValueError, match="not one of lru, lineage, multi_lru"):
        config.connector_config(vllm_config({"eviction_policy": "fifo"}))
    assert config.connector_config(vllm_config({"x": 1}, name="OtherConnector")) is None
    cfg = config.connector_config(vllm_config({"hash_block_size": 64, "cpu_bytes_to_use": 1 << 20}))
    assert cfg.hash_block_size == 64 and cfg.cpu_bytes_to_use == 1 << 20 and cfg.disk_path is None


def test_flags(monkeypatch):
    monkeypatch.setenv("KVBM_DISABLE", "yes")
    assert config.plugin_disabled()
    monkeypatch.setenv("KVBM_COARSE_EVENTS", "maybe")
    with pytest.raises(ValueError, match="KVBM_COARSE_EVENTS"):
        config.coarse_events()
