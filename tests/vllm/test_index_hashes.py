"""events.index computes, without vLLM, the block hashes vLLM's own request hasher computes:
bit-equal for every algorithm it supports, with cache salt and LoRA extra keys."""

import random

import pytest
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from vllm_kvbm_plugin.events.prompt_hashes import PromptHasher, unit_extra_keys

rng = random.Random(3)


def vllm_hashes(algo, tokens, unit, **request_kwargs):
    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)
    req = Request("r", list(tokens), SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(unit, fn), **request_kwargs)
    return list(req.block_hashes)


@pytest.fixture(autouse=True)
def restore_none_hash():
    saved = getattr(kv_cache_utils, "NONE_HASH", None)
    yield
    if saved is not None:
        kv_cache_utils.NONE_HASH = saved


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("unit", [16, 32, 160])
def test_prompt_hashes_are_vllms(algo, unit, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = [rng.randrange(0, 150000) for _ in range(unit * 12 + 7)]
    want = vllm_hashes(algo, tokens, unit)
    h = PromptHasher(algo)
    assert h.hashes(tokens, unit) == [bytes(b) for b in want]
    assert h.event_hashes(tokens, unit) == [maybe_convert_block_hash(b) for b in want]


def test_seed_from_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    tokens = [rng.randrange(0, 2000) for _ in range(100)]
    want = vllm_hashes("sha256", tokens, 16)
    assert PromptHasher("sha256", seed="1234").hashes(tokens, 16) == [bytes(b) for b in want]
    assert PromptHasher("sha256").hashes(tokens, 16) != [bytes(b) for b in want]


def test_cache_salt_and_lora_keys_are_vllms(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = [rng.randrange(0, 2000) for _ in range(80)]
    lora = LoRARequest("adapter", 1, "/loras/adapter")
    want = vllm_hashes("sha256", tokens, 16, cache_salt="tenant-a", lora_request=lora)
    keys = unit_extra_keys(5, 16, lora=("adapter", "/loras/adapter"), cache_salt="tenant-a")
    assert PromptHasher().hashes(tokens, 16, unit_keys=keys) == [bytes(b) for b in want]
