"""Run a real vLLM engine through a scenario and record outputs and the KV event stream.

    python -m vllm_kvbm_plugin.testing.engine_run SPEC.json RESULT.json

Runs in its own process so each scenario gets a fresh vLLM (and plugin) state. SPEC:
    {"model": "qwen3next" | "llama" | "<dir>", "llm": {LLM kwargs}, "events": true,
     "steps": [{"prompts": [[token ids] | {"text": str, "image_rgb": [r, g, b]}, ...],
                "max_tokens": 8, "logprobs": k, "flip_held": bool} | {"reset": true} | {"scale_mamba_state": x}, ...]}
An image prompt gets a 56x56 image of one colour. It may give "tokens" (ids with the model's image
placeholders) instead of "text", several colours ("image_rgb": [[r, g, b], ...], one image each)
and "image_size": [w, h]. Outputs carry "prompt_len", the prompt after placeholder expansion, and
with "logprobs" the first generated token's top-k as [[token, logprob], ...]. "scale_mamba_state"
multiplies every cached Mamba/linear-attention state page by x (in-process engines only): tests use
it to show their oracle notices a wrong recurrent state. "flip_held" steps the engine by hand and,
after the first step that leaves block files open in this process (held for direct loads next
step), flips a byte of each in place: the race of a file changed between verification and load, on
purpose (in-process engines only); the step's result then carries "flipped", the files changed.
RESULT: {"steps": [...per-step outputs...], "events": [recorded batches], "subscriber": {...},
         "group_metadata": [...], "hash_block_size": int, "block_size": int, "offload_tiers": [...],
         "offload_shm_named": bool}
A step with outputs has "events_before": the batches recorded before its requests were sent.
Events go through vLLM's real ZMQ publisher on ipc:// sockets and our Subscriber.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from vllm_kvbm_plugin.events.subscriber import Subscriber

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _model_dir(name: str) -> str:
    from vllm_kvbm_plugin.testing import tiny_models

    return str(tiny_models.build(name)) if name in tiny_models.KINDS else name


def _prompt(p: list[int] | dict[str, Any]) -> Any:
    from vllm.inputs import TokensPrompt

    if isinstance(p, dict):
        from PIL import Image

        size, rgb = tuple(p.get("image_size", (56, 56))), p["image_rgb"]
        images = [Image.new("RGB", size, tuple(c)) for c in (rgb if isinstance(rgb[0], list) else [rgb])]
        data = {"image": images if len(images) > 1 else images[0]}
        if "tokens" in p:  # exact positions: placeholders where the images go
            return TokensPrompt(prompt_token_ids=p["tokens"], multi_modal_data=data)
        return {"prompt": p["text"], "multi_modal_data": data}
    return TokensPrompt(prompt_token_ids=p)


def _worker_hash_block_size(worker: Any) -> int | None:
    return worker.vllm_config.cache_config.hash_block_size


def metric_totals(prefix: str = "vllm:kvbm_") -> dict[str, float]:
    """Our counters in prometheus_client's registry (vLLM's Prometheus stat logger), summed over
    the engine labels: {"name{label=value,...}": total}."""
    import prometheus_client

    out: dict[str, float] = {}
    for metric in prometheus_client.REGISTRY.collect():
        for s in metric.samples:
            if s.name.startswith(prefix) and s.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name"))
                key = f"{s.name}{{{labels}}}"
                out[key] = out.get(key, 0) + s.value
    return out


def _settle(llm: LLM, connector: KVConnectorBase_V1, timeout_s: float = 20.0) -> None:
    """Step the engine (one-token requests that store nothing) while the connector has pending
    push work: writes behind (disk, remote) finish and are announced in a later step. An engine
    core's busy loop keeps stepping while that holds, but an in-process `LLM.generate` returns as
    soon as its outputs are done, so a run that ends right after its last request would otherwise
    race them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    deadline = time.monotonic() + timeout_s
    while connector.has_pending_push_work() and time.monotonic() < deadline:
        llm.generate([TokensPrompt(prompt_token_ids=[5])], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.01)


def _offload_tier_counters(kv_connector: KVConnectorBase_V1 | None) -> list[dict[str, Any]]:
    """Per secondary tier of vLLM's OffloadingConnector (in-process): its type and our tiers'
    failure counters (loads of damaged or foreign entries, failed writes); [] for other connectors."""
    sched = getattr(kv_connector, "connector_scheduler", None)
    tiers = getattr(getattr(sched, "manager", None), "secondary_tiers", None) or []
    return [{"type": type(t).__name__, "failed_loads": getattr(t, "failed_loads", None),
             "failed_writes": getattr(t, "failed_writes", None)} for t in tiers]


def start_engine(spec: dict[str, Any]) -> tuple[LLM, Subscriber | None]:
    """(LLM, Subscriber of its KV events or None) for a scenario spec's "model", "llm" and "events"."""
    from vllm import LLM

    from vllm_kvbm_plugin.events.subscriber import Subscriber

    sock_dir = tempfile.mkdtemp(prefix="kvbm-events-")
    endpoint, replay = f"ipc://{sock_dir}/pub", f"ipc://{sock_dir}/replay"
    # The SSM state in float32 whatever the CPU: vLLM's CPU platform keeps it in bfloat16 only
    # without AVX-512 BF16, and a smaller state page makes a hybrid model's attention block smaller
    # (tiny Qwen3-Next: 96 tokens instead of 160), so scenarios would depend on the machine.
    kwargs: dict[str, Any] = dict(dtype="bfloat16", max_model_len=2048, enforce_eager=True, block_size=32,
                  enable_prefix_caching=True, seed=0, max_num_seqs=8, mamba_ssm_cache_dtype="float32")
    kwargs.update(spec.get("llm", {}))
    if spec.get("events", True):
        kwargs["kv_events_config"] = dict(enable_kv_cache_events=True, publisher="zmq",
                                          endpoint=endpoint, replay_endpoint=replay, topic="kv")
    llm = LLM(model=_model_dir(spec["model"]), **kwargs)
    sub = Subscriber(endpoint, replay, topic="kv", start_seq=0) if spec.get("events", True) else None
    time.sleep(0.3)  # let the SUB socket join before the first batch (replay covers the rest)
    return llm, sub


def _output(o: RequestOutput) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                           "prompt_len": len(o.prompt_token_ids or ())}
    if o.outputs[0].logprobs:
        out["logprobs"] = [[t, lp.logprob] for t, lp in o.outputs[0].logprobs[0].items()]
    return out


def _generate_flipping_held(llm: LLM, prompts: list[Any], sp: SamplingParams) -> tuple[list[Any], int]:
    """The prompts' outputs, the engine stepped by hand; after the first step that leaves block files
    open here (held for direct loads), a byte of each is flipped in place. Returns (outputs, files flipped)."""
    engine, flipped = llm.llm_engine, 0
    done: dict[str, Any] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"flip-{i}", p, sp)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if not flipped:
            flipped = _flip_held_files()
    return [done[f"flip-{i}"] for i in range(len(prompts))], flipped


def _flip_held_files() -> int:
    """Flip the fourth payload byte, in place, of every block file this process holds open."""
    from vllm_kvbm_plugin.tiers import block_dir, block_file

    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(block_dir.SUFFIX) and os.path.isfile(target):
            held.add(target)
    for path in held:
        with open(path, "r+b") as f:
            f.seek(block_file.HEADER_SIZE + 3)
            b = f.read(1)
            f.seek(block_file.HEADER_SIZE + 3)
            f.write(bytes([b[0] ^ 0x40]))
    return len(held)


def _scale_mamba_state(llm: LLM, factor: float) -> int:
    """Multiply the state pages of every Mamba group's layers in place; returns the tensors touched."""
    from vllm.v1.kv_cache_interface import MambaSpec

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    context = runner.compilation_config.static_forward_context
    touched = 0
    for group in runner.kv_cache_config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, MambaSpec):
            for name in group.layer_names:
                for state in context[name].kv_cache:
                    state.mul_(factor)
                    touched += 1
    return touched


def _offload_shm_named(llm: LLM) -> bool:
    """Whether the OffloadingConnector CPU tier's /dev/shm file still has a name while the engine
    runs (a killed engine would leave it behind)."""
    ktc = llm.llm_engine.vllm_config.kv_transfer_config
    return ktc is not None and os.path.exists(f"/dev/shm/vllm_offload_{ktc.engine_id}.mmap")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_kvbm_plugin.events import recording

    llm, sub = start_engine(spec)
    records: list[Any] = []
    steps: list[dict[str, Any]] = []

    def drain(idle_ms: int) -> None:
        if sub is not None:
            while got := sub.poll(idle_ms):
                records.extend(got)

    for step in spec["steps"]:
        before = len(records)  # what a router had received when this step's requests arrived
        if step.get("reset"):
            ok = llm.reset_prefix_cache()
            llm.generate([TokensPrompt(prompt_token_ids=[5])], SamplingParams(max_tokens=1),
                         use_tqdm=False)  # a step publishes the AllBlocksCleared batch
            steps.append({"reset": ok})
        elif "scale_mamba_state" in step:
            steps.append({"scaled": _scale_mamba_state(llm, step["scale_mamba_state"])})
        else:
            sp = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0, ignore_eos=True,
                                extra_args=step.get("extra_args"), logprobs=step.get("logprobs"))
            if step.get("flip_held"):
                outs, flipped = _generate_flipping_held(llm, [_prompt(p) for p in step["prompts"]], sp)
                steps.append({"outputs": [_output(o) for o in outs], "events_before": before, "flipped": flipped})
            else:
                outs = llm.generate([_prompt(p) for p in step["prompts"]], sp, use_tqdm=False)
                steps.append({"outputs": [_output(o) for o in outs], "events_before": before})
        drain(300)
    core = llm.llm_engine.engine_core
    engine_core = getattr(core, "engine_core", None)
    connector = None
    if engine_core is not None:  # in-process
        metadata = engine_core.get_kv_cache_group_metadata()
        sched = engine_core.scheduler
        hbs, bs = sched.hash_block_size, sched.block_size
        kv_connector = getattr(sched, "connector", None)
        if kv_connector is not None:  # KVBMConnector, or vLLM's OffloadingConnector with our tiers
            _settle(llm, kv_connector)
        offload_tiers = _offload_tier_counters(kv_connector)
        side = getattr(kv_connector, "_sched", None)
        if side is not None:  # KVBMConnector's tier accounting, for "idle means nothing pinned"
            connector = side.accounting()  # a leak (an entry still pinned) shows here
    else:
        metadata = core.call_utility("get_kv_cache_group_metadata")  # type: ignore[attr-defined]  # SyncMPClient (engine core in its own process)
        hbs = bs = connector = None
        offload_tiers = []
    drain(1000)
    result = {
        "worker_hash_block_size": llm.collective_rpc(_worker_hash_block_size),
        "steps": steps,
        "events": [json.loads(recording.dump_line(s, b)) for s, b in records],
        "subscriber": vars(sub.stats) if sub else None,
        "group_metadata": metadata,
        "hash_block_size": hbs,
        "connector": connector if engine_core is not None else None,
        "block_size": bs,
        "offload_tiers": offload_tiers,
        "offload_shm_named": _offload_shm_named(llm),
    }
    if sub is not None:
        sub.close()
    core.shutdown()  # stop EngineCore/worker processes in multi-process mode
    return result


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    result = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip slow interpreter teardown of the engine


if __name__ == "__main__":
    main()
