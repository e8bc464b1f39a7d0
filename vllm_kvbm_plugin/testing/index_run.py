"""Run prompts one at a time through a real engine and note, for each, how much of the KV event
stream had arrived before it was sent: a router's view at that moment (tests of events.index).

    python -m vllm_kvbm_plugin.testing.index_run SPEC.json RESULT.json

SPEC as for engine_run ("model", "llm", "steps"), where a step is {"prompt": [token ids]} or
{"reset": true}. RESULT: {"steps": [{"prompt", "events_before", "num_cached_tokens"} | {"reset"}],
"events": [recorded batches], "subscriber", "block_size", "hash_block_size"}.
"""

from __future__ import annotations

import json
from typing import Any
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_kvbm_plugin.events import recording
    from vllm_kvbm_plugin.testing.engine_run import start_engine

    llm, sub = start_engine({**spec, "events": True})
    assert sub is not None  # events on
    records: list[Any] = []
    steps: list[dict[str, Any]] = []

    def drain(idle_ms: int) -> None:
        while got := sub.poll(idle_ms):
            records.extend(got)

    sp = SamplingParams(max_tokens=spec.get("max_tokens", 4), temperature=0, ignore_eos=True)
    for step in spec["steps"]:
        drain(300)
        if step.get("reset"):
            ok = llm.reset_prefix_cache()
            llm.generate([TokensPrompt(prompt_token_ids=[5])], SamplingParams(max_tokens=1), use_tqdm=False)
            steps.append({"reset": ok})
            continue
        before = len(records)
        out = llm.generate([TokensPrompt(prompt_token_ids=step["prompt"])], sp, use_tqdm=False)[0]
        steps.append({"prompt": step["prompt"], "events_before": before,
                      "num_cached_tokens": out.num_cached_tokens})
    drain(1000)
    core: Any = llm.llm_engine.engine_core  # in-process (InprocClient): its engine_core is the EngineCore
    sched = core.engine_core.scheduler
    result = {
        "steps": steps,
        "events": [json.loads(recording.dump_line(s, b)) for s, b in records],
        "subscriber": vars(sub.stats),
        "block_size": sched.block_size,
        "hash_block_size": sched.hash_block_size,
    }
    sub.close()
    llm.llm_engine.engine_core.shutdown()
    return result


def main() -> None:
    result = run(json.load(open(sys.argv[1])))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    os._exit(0)


if __name__ == "__main__":
    main()
