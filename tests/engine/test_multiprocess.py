"""Multi-process engine (EngineCore and worker in their own processes)."""

import pytest

from .test_hybrid_engine import P100, fine, flat

pytestmark = pytest.mark.slow


def test_hybrid_hash_granularity_across_processes(run_engine):
    r = run_engine({"model": "qwen3next", "steps": [{"prompts": [P100]}]},
                   env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})  # test-only: RPC a probe function
    assert r["worker_hash_block_size"] == [32]  # the worker process
    assert [g["hash_block_size"] for g in r["group_metadata"]] == [32, 32]  # EngineCore, by RPC
    units = fine(flat(r))
    assert len(units) == 1 and units[0].token_ids == P100[:96] and units[0].parent_block_hash is None


def test_tiers_across_processes(run_engine, tmp_path):
    """KVBMConnector with EngineCore and the worker in their own processes: the scheduler side
    plans, the worker copies, a second engine process hits on disk; outputs identical."""
    from .helpers import outputs
    from .test_tiers_engine import HIT, PROMPT, REPEAT, spec

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    r = run_engine(spec(REPEAT, cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path)), env=env)
    first, again = outputs(r)
    assert again["num_cached_tokens"] == HIT and again["tokens"] == first["tokens"]
    r2 = run_engine(spec([{"prompts": [PROMPT]}], cpu_bytes_to_use=4 << 20, disk_path=str(tmp_path)), env=env)
    (o,) = outputs(r2)
    assert o["num_cached_tokens"] == HIT and o["tokens"] == first["tokens"]
