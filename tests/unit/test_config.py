import types

import pytest

from vllm_kvbm_plugin import config


def vllm_config(extra, name="KVBMConnector"):
    ktc = types.SimpleNamespace(kv_connector=name, kv_connector_extra_config=extra)
    return types.SimpleNamespace(kv_transfer_config=ktc)


def test_unknown_connector_key_names_the_valid_ones():
    with pytest.raises(ValueError, match="hash_block_sise.*valid keys: hash_block_size"):
        config.connector_extra_config(vllm_config({"hash_block_sise": 32}))


def test_bad_values_and_other_connectors():
    with pytest.raises(ValueError, match="positive integer"):
        config.connector_extra_config(vllm_config({"hash_block_size": 0}))
    assert config.connector_extra_config(vllm_config({"x": 1}, name="OtherConnector")) is None
    assert config.connector_extra_config(vllm_config({"hash_block_size": 64})) == {"hash_block_size": 64}


def test_flags(monkeypatch):
    monkeypatch.setenv("KVBM_DISABLE", "yes")
    assert config.plugin_disabled()
    monkeypatch.setenv("KVBM_COARSE_EVENTS", "maybe")
    with pytest.raises(ValueError, match="KVBM_COARSE_EVENTS"):
        config.coarse_events()
