"""KVBMConnector on a hybrid model (tiny Qwen3-Next: GatedDeltaNet + attention, --block-size 32
inflated to 160): a tier hit restores the attention KV and the recurrent state at the same
position, at hash-unit granularity, with tokens identical to recomputing."""

import random

import pytest

from .helpers import outputs, validate
from .test_tiers_engine import connector

pytestmark = pytest.mark.engine
rng = random.Random(5)
# just before, on and after the physical (160) and hash-unit (32) boundaries, and a short one
LENGTHS = [100, 159, 160, 161, 191, 192, 193, 321, 400]
PROMPTS = [[rng.randrange(10, 2000) for _ in range(n)] for n in LENGTHS]
LLM = {"max_model_len": 1024, "max_num_batched_tokens": 1024}


def expected_hit(n: int) -> int:
    """The last hash-unit boundary before the prompt's last token: vLLM stops a prefill chunk there
    (its prompt checkpoint), so the tier holds the state at that position."""
    return (n - 1) // 32 * 32


def run(run_engine, steps, policy: str | None = None, **extra):
    llm = dict(LLM, kv_transfer_config=connector(**extra)) if extra else LLM
    if policy:  # vLLM's kv_load_failure_policy (its default: fail the request)
        llm["kv_transfer_config"]["kv_load_failure_policy"] = policy
    return run_engine({"model": "qwen3next", "llm": llm, "steps": steps})


@pytest.fixture(scope="module")
def baseline(run_engine):
    return [o["tokens"] for o in outputs(run_engine({"model": "qwen3next", "llm": LLM, "events": False,
                                                     "steps": [{"prompts": PROMPTS}]}))]


def test_hybrid_hits_from_cpu_then_disk_in_a_new_process(run_engine, baseline, tmp_path):
    r = run(run_engine, [{"prompts": PROMPTS}, {"reset": True}, {"prompts": PROMPTS}],
            cpu_bytes_to_use=64 << 20, disk_path=str(tmp_path))
    outs = outputs(r)
    first, again = outs[: len(PROMPTS)], outs[len(PROMPTS):]
    assert [o["num_cached_tokens"] for o in first] == [0] * len(PROMPTS)
    assert [o["num_cached_tokens"] for o in again] == [expected_hit(n) for n in LENGTHS]
    assert [o["tokens"] for o in first] == [o["tokens"] for o in again] == baseline
    assert r["connector"]["cpu"]["busy"] == 0 and r["connector"]["prefetching"] == 0
    v = validate(r)
    assert v.errors == 0, v.report()
    stored = v.report()["stored_by"]
    assert any(k.startswith("CPU/") and "/mamba/" in k for k in stored), stored  # state entries announced
    assert any(k.startswith("STORAGE/") and "/full_attention/" in k for k in stored), stored

    # a new engine process on the same disk_path: the same hits, from disk
    r2 = run(run_engine, [{"prompts": PROMPTS}], cpu_bytes_to_use=64 << 20, disk_path=str(tmp_path))
    outs2 = outputs(r2)
    assert [o["num_cached_tokens"] for o in outs2] == [expected_hit(n) for n in LENGTHS]
    assert [o["tokens"] for o in outs2] == baseline
    assert validate(r2).errors == 0

    # and with a CPU tier of two slots: the rest of each hit is read from disk straight into the
    # KV cache (attention blocks, partial blocks and states alike)
    head = next(tmp_path.rglob("*.kvb")).read_bytes()[:64]
    slot = int.from_bytes(head[40:48], "little")  # the header's payload length
    r3 = run(run_engine, [{"prompts": PROMPTS}], cpu_bytes_to_use=2 * slot, disk_path=str(tmp_path))
    outs3 = outputs(r3)
    assert [o["num_cached_tokens"] for o in outs3] == [expected_hit(n) for n in LENGTHS]
    assert [o["tokens"] for o in outs3] == baseline
    assert r3["connector"]["direct"] == 0 and r3["connector"]["disk"]["busy"] == 0

    # the same, with every file held open for a direct load changed in place after its
    # verification: those loads fail; vLLM takes block-level errors for one KV cache group only, so
    # a hybrid hit with direct loads is loaded asynchronously and fails as a whole (failed_recving):
    # with kv_load_failure_policy recompute its request starts again, and gets the cold tokens
    r4 = run(run_engine, [{"prompts": PROMPTS, "flip_held": True}], cpu_bytes_to_use=2 * slot,
             disk_path=str(tmp_path), policy="recompute")
    assert r4["steps"][0]["flipped"] > 0
    assert "failed; request" in r4["log"] and "recomputes" in r4["log"]
    assert [o["tokens"] for o in outputs(r4)] == baseline
    assert r4["connector"]["direct"] == 0 and r4["connector"]["disk"]["busy"] == 0
