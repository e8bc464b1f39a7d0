"""Image requests through KVBMConnector on tiny Qwen2-VL and LLaVA, with images at exact token
positions relative to the 32-token hash units: after a prefix-cache reset the same images hit the
CPU tier up to the last full unit, other images only up to the unit holding the first image token,
and every output equals a run without the connector."""

import random

import pytest

from .helpers import outputs
from .test_tiers_engine import connector

pytestmark = pytest.mark.engine
UNIT = 32
IMG = "image"
# placeholder ids as the tiny builders assign them, where the image tokens start in them, and
# how many image tokens a 56x56 image becomes (Qwen2-VL: 2x2 merged 14-pixel patches; LLaVA: 4x4
# CLIP patches, fixed whatever the image size)
PLACEHOLDER = {"qwen2vl": ([4, 5, 6], 1, 4), "llava": ([4], 0, 16)}
BIG = {"qwen2vl": ([224, 224], 64)}  # Qwen2-VL only: a larger image gets more tokens
# text-token counts and images; LLaVA's 16 image tokens leave no room for text between two images
# in one unit, nor for an image over three units (Qwen2-VL's 64-token image covers that)
CASES = {
    "qwen2vl": {"at_boundary": [31, IMG, 60], "two_in_one_unit": [35, IMG, 3, IMG, 50],
                "over_units": [40, IMG, 30], "short": [5, IMG, 8]},
    "llava": {"at_boundary": [32, IMG, 60], "two_in_one_unit": [32, IMG, IMG, 50],
              "over_units": [56, IMG, 50], "short": [5, IMG, 5]},
}
TEXT_ONLY = [random.Random(99).randrange(10, 2000) for _ in range(100)]


def image_prompt(model: str, case: str, rgb: list) -> tuple[dict, int, int]:
    """The prompt of `case` with images of colour `rgb`, its first image token's position and its
    length once vLLM has expanded the placeholders."""
    ids, at, n = PLACEHOLDER[model]
    big = case == "over_units" and model in BIG
    if big:
        n = BIG[model][1]
    rng = random.Random(case)  # distinct text per case: no case hits another one's blocks
    tokens, first, length = [], None, 0
    for part in CASES[model][case]:
        if part == IMG:
            first = length + at if first is None else first
            tokens += ids
            length += len(ids) - 1 + n
        else:
            tokens += [rng.randrange(10, 2000) for _ in range(part)]
            length += part
    images = [rgb] * CASES[model][case].count(IMG)
    prompt = {"tokens": tokens, "image_rgb": images, **({"image_size": BIG[model][0]} if big else {})}
    return prompt, first, length


@pytest.mark.parametrize("model", sorted(PLACEHOLDER))
def test_images_through_the_tiers(run_engine, model):
    def batch(rgb):  # every case and a text-only request in one batch
        return [image_prompt(model, c, rgb)[0] for c in CASES[model]] + [TEXT_ONLY]

    red, blue = batch([255, 0, 0]), batch([0, 0, 255])
    steps = [{"prompts": red}, {"reset": True}, {"prompts": red}, {"reset": True}, {"prompts": blue}]
    llm = {"max_model_len": 1024, "limit_mm_per_prompt": {"image": 2}}
    plain = run_engine({"model": model, "llm": llm, "events": False, "steps": steps})
    r = run_engine({"model": model, "events": False, "steps": steps,
                    "llm": {**llm, "kv_transfer_config": connector(cpu_bytes_to_use=64 << 20)}})
    assert [o["tokens"] for o in outputs(r)] == [o["tokens"] for o in outputs(plain)]
    n = len(red)
    once, again, other = (outputs(r)[i * n : (i + 1) * n] for i in range(3))
    for i, case in enumerate([*CASES[model], "text_only"]):
        if case == "text_only":
            image_at = length = len(TEXT_ONLY)
        else:
            _, image_at, length = image_prompt(model, case, [0, 0, 0])
        assert once[i]["prompt_len"] == length, case
        full = (length - 1) // UNIT * UNIT  # vLLM computes at least the last prompt token
        hits = (once[i]["num_cached_tokens"], again[i]["num_cached_tokens"], other[i]["num_cached_tokens"])
        assert hits == (0, full, min(full, image_at // UNIT * UNIT)), case
    # the image reaches the output, so a hit past the first image token would show in the tokens
    assert any(a["tokens"] != b["tokens"] for a, b in zip(once[:-1], other[:-1]))
