"""Hybrid models through vLLM's own OffloadingConnector with KVBMOffloadingSpec (our CPU worker, our
policy, KVBMDiskTier and KVBMRemoteTier): attention blocks and the recurrent state (GDN, Mamba2)
offloaded and loaded back. Every hit must give the tokens, and the first-token logprobs, of an
engine that caches nothing (the oracle of test_hybrid_prefix_oracle.py)."""

import random

import pytest

from vllm_kvbm_plugin.tiers import disk

from .helpers import outputs, validate
from .test_hybrid_prefix_oracle import TOL, logprob_gap
from .test_offloading_engine import flip_high_bytes

pytestmark = pytest.mark.engine
rng = random.Random(30)
P = [rng.randrange(10, 2000) for _ in range(700)]
Q = P[:500] + [rng.randrange(10, 2000) for _ in range(150)]
MODELS = {"qwen3next": {"mamba_ssm_cache_dtype": "float32"}, "granite-hybrid": {"max_num_batched_tokens": 96}}


def offloading(**extra):
    cfg = {"spec_name": "KVBMOffloadingSpec", "spec_module_path": "vllm_kvbm_plugin.offloading",
           "cpu_bytes_to_use": 64 << 20, **extra}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": cfg}


def step(*prompts):
    return {"prompts": list(prompts), "logprobs": 5, "max_tokens": 6}


def spec(model, steps, events=True, **extra):
    llm = {**MODELS[model], "max_model_len": 2048, "kv_transfer_config": offloading(**extra)}
    return {"model": model, "events": events, "steps": steps, "llm": llm}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return request.param


@pytest.fixture(scope="module")
def reference(run_engine, model):
    llm = {**MODELS[model], "max_model_len": 2048, "enable_prefix_caching": False}
    r = run_engine({"model": model, "events": False, "llm": llm, "steps": [step(P), step(Q)]},
                   env={"KVBM_DISABLE": "1"})
    return dict(zip(("P", "Q"), outputs(r)))


def same(got, ref):
    assert got["tokens"] == ref["tokens"], (got["num_cached_tokens"], got["tokens"], ref["tokens"])
    assert logprob_gap(got, ref) <= TOL


def test_cpu_then_disk_in_a_new_process(run_engine, model, reference, tmp_path):
    r = run_engine(spec(model, [step(P), {"reset": True}, step(P), step(Q)], disk_path=str(tmp_path)))
    cold, again, branch = outputs(r)
    print(f"\n{model}: block {r['block_size']}, hits {again['num_cached_tokens']} {branch['num_cached_tokens']}")
    assert cold["num_cached_tokens"] == 0 and again["num_cached_tokens"] > 0
    for got, ref in ((cold, "P"), (again, "P"), (branch, "Q")):
        same(got, reference[ref])
    rep = validate(r).report()
    assert rep["errors"] == 0, rep["first_problems"]
    # a new process on the same disk: the restart index, promoted through the CPU tier
    r2 = run_engine(spec(model, [step(P)], disk_path=str(tmp_path)))
    (o,) = outputs(r2)
    print(f"  disk hit in a new process: {o['num_cached_tokens']}")
    assert 0 < o["num_cached_tokens"] <= again["num_cached_tokens"]
    same(o, reference["P"])
    assert validate(r2).errors == 0
    # every file damaged (bytes flipped, truncated, or another file's entry): all misses, whether
    # the restart scan or the load finds the damage
    files = sorted(tmp_path.rglob("*.kvb"))
    assert files
    for i, f in enumerate(files):
        if i % 3 == 0:
            flip_high_bytes(str(f), disk.HEADER_SIZE)
        elif i % 3 == 1:
            f.write_bytes(f.read_bytes()[:-7])
        else:
            f.write_bytes(files[(i + 1) % len(files)].read_bytes() if len(files) > 1 else b"")
    r3 = run_engine(spec(model, [step(P)], disk_path=str(tmp_path)))
    (o,) = outputs(r3)
    assert o["num_cached_tokens"] == 0
    same(o, reference["P"])
    assert validate(r3).errors == 0


def test_remote_tier_hits_in_a_second_process(run_engine, model, reference, redis_server):
    remote = [{"type": "KVBMRemoteTier", "module_path": "vllm_kvbm_plugin.offloading", "url": redis_server.url}]
    r = run_engine(spec(model, [step(P)], secondary_tiers=remote))
    same(outputs(r)[0], reference["P"])
    r2 = run_engine(spec(model, [step(P)], secondary_tiers=remote))
    (o,) = outputs(r2)
    print(f"\n{model}: remote hit in a second process: {o['num_cached_tokens']}")
    assert o["num_cached_tokens"] > 0
    same(o, reference["P"])
    rep = validate(r2).report()
    assert rep["errors"] == 0, rep["first_problems"]
