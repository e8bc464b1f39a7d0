"""Image requests through vLLM's own OffloadingConnector with KVBMOffloadingSpec on tiny Qwen2-VL
(and LLaVA, CPU and disk tiers):
the same images hit the CPU tier, the disk tier in a new process and the remote tier in a second
process up to the last full block; other images of the same size (identical token ids) hit only up
to the block holding the first image token; every output equals a run without offloading."""

import pytest

from vllm_kvbm_plugin.events.index import KVIndex
from vllm_kvbm_plugin.events.prompt_hashes import unit_extra_keys
from vllm_kvbm_plugin.events.types import BlockStored

from .helpers import batches, index_predictions, outputs, validate
from .test_multimodal_engine import BIG, CASES, PLACEHOLDER, TEXT_ONLY, UNIT, image_prompt
from .test_offloading_hybrid import WARM_UP, offloading, router_config

pytestmark = pytest.mark.engine
MODEL = "qwen2vl"
LLM = {"max_model_len": 1024, "limit_mm_per_prompt": {"image": 2}}


def batch(rgb, model=MODEL):  # every case and a text-only request in one batch
    return [image_prompt(model, c, rgb)[0] for c in CASES[model]] + [TEXT_ONLY]


RED, BLUE = batch([255, 0, 0]), batch([0, 0, 255])


def expected_hits(same_image: bool, model=MODEL) -> list[int]:
    out = []
    for case in [*CASES[model], "text_only"]:
        if case == "text_only":
            image_at = length = len(TEXT_ONLY)
        else:
            _, image_at, length = image_prompt(model, case, [0, 0, 0])
        full = (length - 1) // UNIT * UNIT  # vLLM computes at least the last prompt token
        out.append(full if same_image else min(full, image_at // UNIT * UNIT))
    return out


def tier_image_keys(result) -> int:
    """Checks that every offload-tier event (CPU, STORAGE) carries, per block, the extra_keys the
    GPU events gave the same hash (image identity and offset); returns how many tier blocks carry
    an image key."""
    gpu, tier = {}, []
    for _, b in batches(result):
        for e in b.events:
            if isinstance(e, BlockStored):
                keys = e.extra_keys or [None] * len(e.block_hashes)
                for h, k in zip(e.block_hashes, keys):
                    if e.medium in (None, "GPU"):
                        gpu[h] = k
                    else:
                        tier.append((e.medium, h, k))
    assert tier, "no tier events"
    wrong = [(m, h, k, gpu.get(h, "not on GPU")) for m, h, k in tier if h not in gpu or gpu[h] != k]
    assert not wrong, wrong[:5]
    return sum(k is not None for _, _, k in tier)


def expanded(prompt) -> tuple[list[int], list[tuple[int, int]]]:
    """A prompt's token ids once vLLM has expanded its image placeholders, and its images'
    (offset, length) there."""
    if not isinstance(prompt, dict):
        return list(prompt), []
    ids, at, n = PLACEHOLDER[MODEL]
    n = BIG[MODEL][1] if "image_size" in prompt else n
    out, images = [], []
    for t in prompt["tokens"]:
        if t == ids[at]:
            images.append((len(out), n))
            out += [t] * n
        else:
            out.append(t)
    return out, images


def image_identifiers(result, upto: int | None = None) -> dict:
    """(a block's tokens, an image's offset in it) -> the image's identifier, from the GPU events
    (the first `upto` batches: those of one colour): the test's stand-in for the multimodal hash a
    router computes from a request's image."""
    out = {}
    for _, b in batches(result)[:upto]:
        for e in b.events:
            if isinstance(e, BlockStored) and e.medium in (None, "GPU") and e.extra_keys:
                for i, keys in enumerate(e.extra_keys):
                    block = tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
                    for k in keys or ():
                        if isinstance(k, list) and len(k) == 2 and isinstance(k[0], str):
                            out[(block, k[1])] = k[0]
    return out


def predicted_keys(prompts: list, identifiers: dict) -> tuple[list, list]:
    """The expanded prompts and their per-unit keys as `KVIndex.match` takes them; an image the
    events never showed gets an identifier of its own (a new image: nothing holds it)."""
    tokens, keys = [], []
    for p in prompts:
        ids, images = expanded(p)
        named = []
        for off, n in images:
            start = off // UNIT * UNIT
            named.append((off, n, identifiers.get((tuple(ids[start:start + UNIT]), off - start), f"new@{off}")))
        tokens.append(ids)
        keys.append(unit_extra_keys(len(ids) // UNIT, UNIT, images=named) if named else None)
    return tokens, keys


def run(run_engine, steps, **extra):
    return run_engine({"model": MODEL, "steps": steps, "llm": {**LLM, "kv_transfer_config": offloading(**extra)}})


@pytest.fixture(scope="module")
def plain(run_engine):
    r = run_engine({"model": MODEL, "llm": LLM, "events": False, "steps": [{"prompts": RED}, {"prompts": BLUE}]})
    n = len(RED)
    return [o["tokens"] for o in outputs(r)[:n]], [o["tokens"] for o in outputs(r)[n:]]


def test_images_hit_cpu_then_disk_in_a_new_process(run_engine, plain, tmp_path):
    red, blue = plain
    assert red != blue  # the image reaches the output: a hit past an image token would show
    r = run(run_engine, [{"prompts": RED}, {"reset": True}, {"prompts": RED}, {"reset": True}, {"prompts": BLUE}],
            disk_path=str(tmp_path))
    n = len(RED)
    once, again, other = (outputs(r)[i * n:(i + 1) * n] for i in range(3))
    assert [o["num_cached_tokens"] for o in once] == [0] * n
    assert [o["num_cached_tokens"] for o in again] == expected_hits(True)
    assert [o["num_cached_tokens"] for o in other] == expected_hits(False)
    assert [o["tokens"] for o in once] == [o["tokens"] for o in again] == red
    assert [o["tokens"] for o in other] == blue
    rep = validate(r).report()
    assert rep["errors"] == 0, rep["first_problems"]
    assert {t.split(":")[0] for t in rep["tiers"]} == {"GPU", "CPU", "STORAGE"}
    assert tier_image_keys(r) > 0
    # the router index predicts every hit: red images from the CPU tier, blue ones up to their image
    cfg = router_config(r)
    red_only = next(s["events_before"] for s in r["steps"][1:] if "outputs" in s)  # before the second red step
    tokens, keys = predicted_keys(RED, image_identifiers(r, red_only))
    blue_tokens, blue_keys = predicted_keys(BLUE, {})
    predicted = index_predictions(r, tokens * 2 + blue_tokens, cfg, extra_keys=keys * 2 + blue_keys)
    assert all(p == served for p, served in predicted), predicted
    # a new process on the same disk: its first step (a one-token warm-up, as a server's first
    # request would be) announces the disk tier's restart index, from which alone the router
    # index predicts every red hit
    r2 = run(run_engine, [WARM_UP, {"prompts": RED}], disk_path=str(tmp_path))
    warm, *hits = outputs(r2)
    assert [o["num_cached_tokens"] for o in hits] == expected_hits(True)
    assert [o["tokens"] for o in hits] == red
    assert validate(r2).errors == 0
    predicted = index_predictions(r2, WARM_UP["prompts"] + tokens, router_config(r2), extra_keys=[None] + keys)
    assert predicted == [(0, 0)] + [(n, n) for n in expected_hits(True)], predicted


def test_images_hit_the_remote_tier_in_a_second_process(run_engine, plain, redis_server):
    red, blue = plain
    remote = [{"type": "KVBMRemoteTier", "module_path": "vllm_kvbm_plugin.offloading", "url": redis_server.url}]
    r1 = run(run_engine, [{"prompts": RED}], secondary_tiers=remote)
    assert any(t.startswith("STORAGE:REMOTE") for t in validate(r1).report()["tiers"])
    assert tier_image_keys(r1) > 0
    r2 = run(run_engine, [{"prompts": RED}, {"prompts": BLUE}], secondary_tiers=remote)
    n = len(RED)
    assert [o["num_cached_tokens"] for o in outputs(r2)[:n]] == expected_hits(True)
    assert [o["num_cached_tokens"] for o in outputs(r2)[n:]] == expected_hits(False)
    assert [o["tokens"] for o in outputs(r2)] == red + blue
    rep = validate(r1, r2).report()  # r2 chains its remote stores to r1's: one merged stream
    assert rep["errors"] == 0, rep["first_problems"]
    assert tier_image_keys(r2) > 0
    # the router index, fed r1's stream, predicts r2's hits: red images from the shared remote
    # tier, blue ones (new images) from r2's own GPU cache up to their first image unit
    cfg = router_config(r1, remote="all")
    index = KVIndex(cfg)
    identifiers = image_identifiers(r1)
    assert len(set(identifiers.values())) == 2  # the 56x56 and the 224x224 red image
    tokens, keys = predicted_keys(RED, identifiers)
    assert index_predictions(r1, tokens, cfg, "A", index, keys) == [(0, 0)] * n
    blue_tokens, blue_keys = predicted_keys(BLUE, {})  # new images: identifiers of their own
    predicted = index_predictions(r2, tokens + blue_tokens, cfg, "B", index, keys + blue_keys)
    assert all(p == served for p, served in predicted), predicted
    assert [p for p, _ in predicted] == expected_hits(True) + expected_hits(False)


def test_llava_images_hit_cpu_then_disk_in_a_new_process(run_engine, tmp_path):
    """LLaVA (a fixed 16 tokens per image) through the same path: the same images hit the CPU tier
    and the disk tier in a new process, other images of the same size only up to their first image
    unit, every output as without offloading."""
    red, blue = batch([255, 0, 0], "llava"), batch([0, 0, 255], "llava")
    llm = {"model": "llava", "llm": LLM}
    p = outputs(run_engine({**llm, "events": False, "steps": [{"prompts": red}, {"prompts": blue}]}))
    n = len(red)
    plain_red, plain_blue = [o["tokens"] for o in p[:n]], [o["tokens"] for o in p[n:]]
    assert plain_red != plain_blue
    steps = [{"prompts": red}, {"reset": True}, {"prompts": red}, {"reset": True}, {"prompts": blue}]
    r = run_engine({**llm, "steps": steps, "llm": {**LLM, "kv_transfer_config": offloading(disk_path=str(tmp_path))}})
    once, again, other = (outputs(r)[i * n:(i + 1) * n] for i in range(3))
    assert [o["num_cached_tokens"] for o in again] == expected_hits(True, "llava")
    assert [o["num_cached_tokens"] for o in other] == expected_hits(False, "llava")
    assert [o["tokens"] for o in once] == [o["tokens"] for o in again] == plain_red
    assert [o["tokens"] for o in other] == plain_blue
    assert validate(r).errors == 0 and tier_image_keys(r) > 0
    r2 = run_engine({**llm, "steps": [WARM_UP, {"prompts": red}],
                     "llm": {**LLM, "kv_transfer_config": offloading(disk_path=str(tmp_path))}})
    _, *hits = outputs(r2)
    assert [o["num_cached_tokens"] for o in hits] == expected_hits(True, "llava")
    assert [o["tokens"] for o in hits] == plain_red
