"""Run a real vLLM engine through a position-independent-load scenario (tests/engine/test_pic_engine.py).

    python -m vllm_kvbm_plugin.testing.pic_run SPEC.json OUT_DIR

SPEC: {"model": "llama", "llm": {LLM kwargs}, "steps": [{"prompt": [ids], "salt": str | null,
"max_tokens": 8, "capture": name | null, "logprobs": bool, "one_forward": bool} | {"reset": true} |
{"batch": [{"prompt", "salt"}, ...]} | {"ratio": float}: the workers' pic_recompute_ratio from then on
(> 0 both: the scheduler side plans alike), ...]}. One request per step; each records "blend" (this
process's patches.pic_blend.STATS so far) and "eager" (the model's forwards run outside the
compiled graph so far: with enforce_eager, every one).
OUT_DIR gets result.json ({"steps": [{"tokens", "num_cached_tokens", "pic": the planner's stats after the
step, "logprobs": the first token's
log-probabilities over the whole vocabulary (needs llm max_logprobs -1), "margins": each generated
token's top-2 margin (with "logprobs")}], "pic": the planner's stats or null, "blend":
patches.pic_blend.STATS of this process (the worker's, without tensor parallelism), "blend_ranks":
each worker's, with "kept": per blended step, the rows the layers after the selection ran (one per
tensor-parallel rank; workers in their own processes need VLLM_ALLOW_INSECURE_SERIALIZATION=1)}) and,
per captured step, <name>.pt: the request's layer-0 KV cache blocks [blocks, heads, block, 2*head],
read right after it finished (the worker's own tensor, before any other request runs).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from vllm.inputs import TokensPrompt

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _layer0_blocks(worker: Any, block_ids: list[int]) -> torch.Tensor:
    """The first attention layer's KV of `block_ids` (runs in the worker, in-process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_kvbm_plugin.connector import KVBMConnector
    from vllm_kvbm_plugin.connector.layout import KV

    side = cast(KVBMConnector, get_kv_transfer_group())._worker
    assert side is not None  # a worker process
    g = side.layout.groups[KV][0]
    names = side.layout.layer_names[g]
    (i,) = [i for i, n in enumerate(names) if ".layers.0." in n]
    return side.layers[KV][0][i].tensor[list(block_ids)].clone()


def _record_kept(worker: Any) -> None:
    """Record each blended step's kept rows (after the compute saving's gather) on this worker
    (`worker.kvbm_kept`: RPC'd functions of a `python -m` module travel by value, their globals too)."""
    from vllm_kvbm_plugin.patches.pic_blend import BlendPlan

    kept = worker.kvbm_kept = []
    gather = BlendPlan.gather

    def recording(self: BlendPlan, *args: Any, **kwargs: Any) -> None:
        gather(self, *args, **kwargs)
        assert self.kept is not None  # gather sets it
        kept.append(self.kept.tolist())

    BlendPlan.gather = recording  # type: ignore[method-assign]  # recorded in this worker only


def _blend_stats(worker: Any) -> dict[str, Any]:
    """patches.pic_blend.STATS of a worker process (each tensor-parallel rank has its own) and the
    rows `_record_kept` recorded."""
    from vllm_kvbm_plugin.patches import pic_blend

    return {**pic_blend.STATS, "kept": worker.kvbm_kept}


def _set_ratio(worker: Any, ratio: float) -> None:
    """This worker's pic_recompute_ratio from now on (a test's engine serves several ratios)."""
    import dataclasses

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_kvbm_plugin.connector import KVBMConnector

    side = cast(KVBMConnector, get_kv_transfer_group())._worker
    assert side is not None  # a worker process
    side.cfg = dataclasses.replace(side.cfg, pic_recompute_ratio=ratio)


def _record_eager(worker: Any) -> None:
    """Count the model's forwards that run its layers' Python code (`worker.kvbm_eager`): in a
    compiled model only the steps that skip the graph do (the graph's code replaces the model's
    forward, not its layers'). Applied after the graph was traced."""
    model = worker.model_runner.model.model
    first = model.layers[model.start_layer]
    cls = type(first)
    forward = cls.forward
    worker.kvbm_eager = [0]

    @functools.wraps(forward)  # keeps our patch's mark (pic_blend.compute_saving_applied reads it)
    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is first:
            worker.kvbm_eager[0] += 1
        return forward(self, *args, **kwargs)

    cls.forward = counting


def _eager_count(worker: Any) -> int:
    count: int = worker.kvbm_eager[0]
    return count


def _margin(logprobs: dict[int, Any]) -> float:
    """A generated token's top-2 margin (log-probability of the best minus the second best)."""
    top = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return top[0] - top[1]


def _prompt(ids: list[int], salt: str | None) -> TokensPrompt:
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=ids)
    if salt:
        prompt["cache_salt"] = salt
    return prompt


def run(spec: dict[str, Any], out_dir: str) -> dict[str, Any]:
    import torch
    from vllm import SamplingParams

    from vllm_kvbm_plugin.testing.engine_run import metric_totals, start_engine

    llm, _ = start_engine({**spec, "events": False})
    core: Any = llm.llm_engine.engine_core  # in-process (InprocClient): its engine_core is the EngineCore
    sched = core.engine_core.scheduler
    connector = sched.connector
    finished: list[Any] = []
    if connector is not None:  # the block ids of each finished request, as vLLM hands them over
        original = connector.request_finished_all_groups

        def request_finished_all_groups(request: Any, block_ids: Any) -> Any:
            finished.append(block_ids)
            return original(request, block_ids)

        connector.request_finished_all_groups = request_finished_all_groups
    pic = getattr(getattr(connector, "_sched", None), "pic", None)
    one_forward = pic is not None and pic.one_forward
    from vllm_kvbm_plugin.patches import pic_blend, pic_segments

    llm.collective_rpc(_record_kept)
    llm.collective_rpc(_record_eager)
    steps: list[dict[str, Any]] = []
    for step in spec["steps"]:
        if step.get("reset"):
            steps.append({"reset": llm.reset_prefix_cache()})
            continue
        if "ratio" in step:
            llm.collective_rpc(_set_ratio, args=(step["ratio"],))
            steps.append({"ratio": step["ratio"]})
            continue
        if step.get("batch"):  # several requests in one generate call (scheduled together)
            prompts = [_prompt(b["prompt"], b.get("salt")) for b in step["batch"]]
            outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
            steps.append({"batch_tokens": [list(o.outputs[0].token_ids) for o in outs],
                          "pic": dict(pic.stats) if pic is not None else None, "segments": dict(pic_segments.STATS),
                          "blend": dict(pic_blend.STATS), "eager": llm.collective_rpc(_eager_count)[0]})
            continue
        prompt = _prompt(step["prompt"], step.get("salt"))
        if pic is not None:  # false: one step per loaded run past a gap, as without patches/pic_segments.py
            pic.one_forward = step.get("one_forward", one_forward)
        sp = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0, ignore_eos=True,
                            logprobs=-1 if step.get("logprobs") else None)
        (o,) = llm.generate([prompt], sp, use_tqdm=False)
        steps.append({"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                      "pic": dict(pic.stats) if pic is not None else None,  # the planner's totals so far
                      "segments": dict(pic_segments.STATS),  # split forwards so far (worker: this process)
                      "blend": dict(pic_blend.STATS), "eager": llm.collective_rpc(_eager_count)[0]})
        if step.get("logprobs"):
            logprobs: Any = o.outputs[0].logprobs  # per generated token: {token id: Logprob}
            first = logprobs[0]
            steps[-1]["logprobs"] = [first[t].logprob for t in range(len(first))]
            steps[-1]["margins"] = [_margin(lps) for lps in logprobs]
        if step.get("capture"):
            (kv,) = llm.collective_rpc(_layer0_blocks, args=(finished[-1][0],))
            torch.save(kv, os.path.join(out_dir, f"{step['capture']}.pt"))
    side = getattr(connector, "_sched", None)

    result = {"steps": steps, "pic": dict(pic.stats) if pic is not None else None, "blend": dict(pic_blend.STATS),
              "blend_ranks": llm.collective_rpc(_blend_stats),
              "accounting": side.accounting() if side is not None else None,
              "metrics": metric_totals()}  # vLLM's Prometheus stat logger (when log stats are on)
    llm.llm_engine.engine_core.shutdown()
    return result


def main() -> None:
    spec, out_dir = json.load(open(sys.argv[1])), sys.argv[2]
    result = run(spec, out_dir)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip slow interpreter teardown of the engine


if __name__ == "__main__":
    main()
