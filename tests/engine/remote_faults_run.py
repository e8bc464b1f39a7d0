"""One in-process engine (tiny Llama) through remote-tier faults with its own redis-server, in the
order of issue 11's acceptance: the server SIGKILLed between requests and during a write burst,
restarted on the same port (stores and a remote hit without restarting the engine), `CLIENT
PAUSE 3000` while requests run. Scheduler steps are timed from inside the engine (the Scheduler's
schedule / update_from_output, where the connector's scheduler side runs) and so are the
connector's worker-side calls. Metrics come from vLLM's own Prometheus stat logger.

    python -m tests.engine.remote_faults_run SPEC.json RESULT.json

SPEC: {"connector": bool, "budget_ms": float, "prompts": {name: [token ids] | [[token ids], ...]}}.
With "connector": false the same requests run without a connector and no server (the baseline).
RESULT: {"outputs": {name: [{"tokens", "num_cached_tokens"}, ...]}, "facts": {...}}
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _timed(obj, name: str, into: list) -> None:
    """Wrap obj.name so each call's duration lands in `into` (while `into` is being collected)."""
    f = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            into.append((name, time.perf_counter() - t0))
    setattr(obj, name, timed)


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_kvbm_plugin.testing import tiny_models
    from vllm_kvbm_plugin.testing.redis_server import RedisServer

    p = spec["prompts"]
    on = spec["connector"]
    server = RedisServer().start() if on else None
    ktc = None
    if on:
        ktc = {"kv_connector": "KVBMConnector", "kv_connector_module_path": "vllm_kvbm_plugin.connector",
               "kv_role": "kv_both", "kv_connector_extra_config": {
                   "cpu_bytes_to_use": 1 << 20,  # 64 blocks of 16 KiB: the fillers evict the rest
                   "remote_url": server.url, "remote_lookup_budget_ms": spec["budget_ms"]}}
    llm = LLM(model=str(tiny_models.build("llama")), dtype="bfloat16", max_model_len=1024, enforce_eager=True,
              block_size=32, enable_prefix_caching=True, seed=0, max_num_seqs=16, disable_log_stats=not on,
              kv_transfer_config=ktc)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    outputs, facts = {}, {}
    calls: list = []  # (name, seconds) of timed calls, while collecting
    side = worker = None
    if on:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        side, worker = sched.connector._sched, get_kv_transfer_group()._worker
        for name in ("schedule", "update_from_output"):
            _timed(sched, name, calls)
        for name in ("start_load_kv", "wait_for_save", "build_connector_worker_meta"):
            _timed(get_kv_transfer_group(), name, calls)

    def gen(name: str, max_tokens: int = 8, on_step=None) -> None:
        prompts = p[name] if isinstance(p[name][0], list) else [p[name]]
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        if on_step is not None:
            _hook(sched, on_step)
        try:
            outs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in prompts], sp, use_tqdm=False)
        finally:
            if on_step is not None:
                _unhook(sched)
        outputs.setdefault(name, []).extend(
            {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens} for o in outs)

    def until(cond, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stored() -> int:
        """How many block values the server holds (ours: one layout, one rank; not the key secret)."""
        return sum(1 for _ in server.client().scan_iter(match="kvbm:*"))

    def breakers_ready() -> bool:
        return side.tier("remote").breaker.allow_soon() and worker.tier("remote").breaker.allow_soon()

    try:
        # 1. a request stores; the server is SIGKILLed between requests; the next is a miss
        gen("first")
        if on:
            facts["stored_before_kill"] = until(lambda: stored() >= 6, 10)
            server.kill()
        gen("while_down")
        # 2. restarted empty on the same port; SIGKILL while a burst of requests is written behind
        if on:
            server.start()
            until(breakers_ready, 35)
            facts["writing_at_kill"] = 0

            def kill_when_writing():
                if server.proc is not None and side.tier("remote").writing:
                    facts["writing_at_kill"] = len(side.tier("remote").writing)
                    server.kill()
        gen("burst", max_tokens=24, on_step=kill_when_writing if on else None)
        # 3. restarted again: stores resume and a stored prefix is a remote hit, same engine
        if on:
            server.start()
            facts["breakers_ready_s"] = time.monotonic()
            facts["breakers_ready"] = until(breakers_ready, 35)
            facts["breakers_ready_s"] = round(time.monotonic() - facts["breakers_ready_s"], 2)
        gen("after_restart")  # two prompts: one for the remote hit, one for the pause
        if on:
            facts["stored_after_restart"] = until(lambda: stored() >= 12, 10)
        gen("fill")  # evicts both from the 64-slot CPU tier
        llm.reset_prefix_cache()
        fetched = side.tier("remote").counters["fetched"] if on else 0
        gen("hit")
        if on:
            facts["fetched_for_hit"] = side.tier("remote").counters["fetched"] - fetched
        # 4. CLIENT PAUSE 3000 while requests (one of them stored on the server) run
        if on:
            time.sleep(0.3)  # the writes behind of the fillers are done
            server.client().execute_command("CLIENT", "PAUSE", 3000)
            t_pause = time.monotonic()
            calls.clear()
            felt = sum(side.tier("remote").counters[k] for k in ("lookup_timeouts", "lookup_failures", "fetch_misses"))
        gen("paused")
        if on:
            facts["pause_run_s"] = time.monotonic() - t_pause
            facts["pause_misses"] = sum(side.tier("remote").counters[k] for k in
                                        ("lookup_timeouts", "lookup_failures", "fetch_misses")) - felt
            facts["longest"] = {n: max((s for c, s in calls if c == n), default=0.0) for n, _ in calls}
            facts["steps_timed"] = sum(1 for c, _ in calls if c == "schedule")
            time.sleep(max(0.0, 3.2 - (time.monotonic() - t_pause)))
            until(breakers_ready, 35)
        gen("after_pause")  # the stats of the last writes and breaker changes reach the loggers
        if on:
            time.sleep(0.3)
            gen("after_pause")
            facts["counters"] = dict(side.tier("remote").counters)
            facts["breakers"] = {"scheduler": [side.tier("remote").breaker.opened, side.tier("remote").breaker.closed],
                                 "worker": [worker.tier("remote").breaker.opened, worker.tier("remote").breaker.closed]}
            from vllm_kvbm_plugin.testing.engine_run import metric_totals

            facts["metrics"] = metric_totals()
            facts["accounting"] = side.accounting()
    finally:
        if server is not None:
            server.stop()
    llm.llm_engine.engine_core.shutdown()
    return {"outputs": outputs, "facts": facts}


_ORIGINAL = "_kvbm_test_update_from_output"


def _hook(sched, fn) -> None:
    """Call fn() after each scheduler update (the connector's reports of the step are in)."""
    f = sched.update_from_output
    setattr(sched, _ORIGINAL, f)

    def hooked(*args, **kwargs):
        out = f(*args, **kwargs)
        fn()
        return out
    sched.update_from_output = hooked


def _unhook(sched) -> None:
    sched.update_from_output = getattr(sched, _ORIGINAL)


def main() -> None:
    result = run(json.load(open(sys.argv[1])))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip slow interpreter teardown of the engine


if __name__ == "__main__":
    main()
