"""The decision of patches/hash_granularity.py, on stand-ins for the few config fields it reads
(the case "vLLM cannot split its blocks at the user's size" cannot be produced by a real engine on
this machine: CPU inflation always yields multiples of the block size)."""

import types

import pytest

pytest.importorskip("vllm")
from vllm_kvbm_plugin.patches import hash_granularity as hg  # noqa: E402


def setup(block=32, inflated=(160, 160), user=True, pmu=None, events=True, caching=True, hybrid=True,
          extra=None):
    cc = types.SimpleNamespace(block_size=block, user_specified_block_size=user, prefix_match_unit=pmu,
                               enable_prefix_caching=caching)
    ktc = None if extra is None else types.SimpleNamespace(kv_connector="KVBMConnector",
                                                            kv_connector_extra_config=extra)
    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(is_hybrid=hybrid), cache_config=cc,
                                kv_events_config=types.SimpleNamespace(enable_kv_cache_events=events),
                                kv_transfer_config=ktc)
    specs = [{f"l{i}": types.SimpleNamespace(block_size=b, prefix_cacheable=True) for i, b in enumerate(inflated)}]
    core = types.SimpleNamespace(model_executor=types.SimpleNamespace(get_kv_cache_specs=lambda: specs))
    return core, cfg


def test_user_block_size_is_kept_when_inflated():
    assert hg._preferred_unit(*setup()) == 32


def test_vllms_choice_stands_when_it_must():
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("vllm.kvbm.patches").addHandler(handler)
    assert hg._preferred_unit(*setup(pmu=64)) is None  # an explicit --prefix-match-unit wins
    assert hg._preferred_unit(*setup(hybrid=False)) is None
    assert hg._preferred_unit(*setup(user=False)) is None
    assert hg._preferred_unit(*setup(inflated=(32, 32))) is None  # nothing was inflated
    assert hg._preferred_unit(*setup(events=False, caching=False)) is None
    assert hg._preferred_unit(*setup(inflated=(160, 144))) is None  # 144 is not a multiple of 32...
    assert any("not multiples of it" in m for m in seen)  # ...and the warning says why
    logging.getLogger("vllm.kvbm.patches").removeHandler(handler)


def test_connector_hash_block_size_wins_over_the_block_size():
    assert hg._preferred_unit(*setup(extra={"hash_block_size": 80})) == 80
    with pytest.raises(ValueError, match="valid keys"):
        hg._preferred_unit(*setup(extra={"hash_blok_size": 80}))
