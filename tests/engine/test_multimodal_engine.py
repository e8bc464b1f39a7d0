"""Image requests through KVBMConnector on a tiny Qwen2-VL: the same image hits the tier, another
image with the same text shares only the blocks before the image, outputs equal a run without
the connector."""

import pytest

from .helpers import outputs
from .test_tiers_engine import connector

pytestmark = pytest.mark.engine
BEFORE = "hello world " * 10
TEXT = BEFORE + "<|vision_start|><|image_pad|><|vision_end|>" + " describe the picture" * 12
RED, BLUE = {"text": TEXT, "image_rgb": [255, 0, 0]}, {"text": TEXT, "image_rgb": [0, 0, 255]}
STEPS = [{"prompts": [RED]}, {"reset": True}, {"prompts": [RED]}, {"reset": True}, {"prompts": [BLUE]}]
LLM_ARGS = {"max_model_len": 1024, "limit_mm_per_prompt": {"image": 2}}


def test_images_through_the_tiers(run_engine):
    from transformers import AutoTokenizer

    from vllm_kvbm_plugin.testing import tiny_models

    plain = run_engine({"model": "qwen2vl", "llm": LLM_ARGS, "events": False, "steps": STEPS})
    r = run_engine({"model": "qwen2vl", "events": False, "steps": STEPS,
                    "llm": {**LLM_ARGS, "kv_transfer_config": connector(cpu_bytes_to_use=64 << 20)}})
    assert [o["tokens"] for o in outputs(r)] == [o["tokens"] for o in outputs(plain)]
    red, red_again, blue = outputs(r)
    assert red["num_cached_tokens"] == 0 and red_again["num_cached_tokens"] >= 192
    # the first image token sits right after <|vision_start|>: blocks from there on differ
    tok = AutoTokenizer.from_pretrained(tiny_models.build("qwen2vl"))
    first_image_token = len(tok(BEFORE)["input_ids"]) + 1
    assert blue["num_cached_tokens"] == first_image_token // 32 * 32 > 0
