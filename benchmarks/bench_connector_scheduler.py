"""Scheduler CPU time with KVBMConnector's scheduler side against the same Scheduler without a
connector, same run, same workload.

vLLM's real Scheduler runs in-process (testing.scheduler.SchedulerHarness) with the connector's CPU
tier; its real WorkerSide runs each step's copies (testing.scheduler.SimulatedWorker), but only the
scheduler's own calls are timed: `schedule()` and `update_from_output()`, which is where the
connector's scheduler side runs (lookups, hit planning, store bookkeeping, metadata, events) and
what sits on every token's critical path in an engine. Timed is the calling thread's CPU time
(`time.thread_time`): other threads of this process (the simulated worker's copy helpers, torch's
OpenMP pool) ran during the timed calls, and process CPU time billed them to the scheduler (half
of the store pass's "overhead" up to session 21); the connector's scheduler side runs no thread of
its own. Also printed: the connector's own hooks' time (`timed_scheduler` says why that is the
figure a GPU engine would see), and with `--native` the same for a connector that does nothing
(null_connector.py: vLLM's own cost of having one) and vLLM's OffloadingConnector, and the "wire":
what the connector adds to the messages between the engine core and the workers (its metadata,
the workers' output), as the engine core's CPU to pickle and unpickle them and their bytes, the
part of the engine's critical path a single process does not show. Two passes over
the same requests:

- store: every prompt computed and offloaded (no tier hits): the connector's bookkeeping alone,
  over the very same steps as without it;
- hit: vLLM's prefix cache reset, the same requests again: with the connector they load from the
  CPU tier (fewer tokens to schedule), without it they recompute.

Also printed: how long a full garbage collection takes after the store pass (what the run left
behind, the tier's entries among it), the pause it would make in an engine core.

The heap is frozen after the harness is built, as vLLM's engine core freezes it after startup
(without that a full collection of the ~760k objects vLLM's import made lands in whichever
run allocates more: 0.4 s). Runs alternate (without, with, ...); printed per pass: the best of --reps runs of each, the ratio,
steps, and the tokens the tier served. Geometries: Llama-like (one attention group, block 32) and
Nemotron-like hybrid (a Mamba group and an attention group, block 2176, hash unit 64).

    python benchmarks/bench_connector_scheduler.py [--requests 200] [--reps 3]
"""

import argparse
import gc
import os
import pickle
import time

import vllm
import vllm.envs

from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness

from timing import shared_prefix_workload

GEOMETRIES = {
    "llama-like (32)": dict(hybrid=False, block_size=32, hash_block_size=None, num_blocks=4000),
    "nemotron-like (2176/64)": dict(hybrid=True, block_size=2176, hash_block_size=64, num_blocks=120),
}


# the connector's scheduler-side hooks vLLM's Scheduler calls (every stack's, KVConnectorBase_V1)
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "request_finished_all_groups", "take_events", "get_kv_connector_stats")


def timed_scheduler(sched) -> list:
    """Times the scheduler's two calls into the returned [CPU seconds, steps, of which in the
    connector's own hooks, what crossed processes] (the caller counts steps; `wire` prices the
    last); events are sent, not kept, as vLLM's
    publisher does; startup's objects are frozen and vLLM's environment cached, as vLLM's engine
    core does after startup (collections skip those objects; without the cache every event-hash
    conversion reads the environment).

    The hooks' own time is the connector's cost as a GPU engine would see it: the rest of what a
    connector run adds is vLLM's own code running with cold caches, because the simulated
    workers' copies and forward sweep memory between the steps in this process (sweeping 64 MiB
    between the steps of the no-connector run makes its hybrid store pass 63 -> 110 ms); on a GPU
    the copies are DMA and the forward runs on the device."""
    spent = [0.0, 0, 0.0, []]
    sched.kv_event_publisher.publish = lambda batch: None
    gc.collect()
    gc.freeze()
    vllm.envs.enable_envs_cache()  # as the engine core after startup: vLLM's hash conversions read no env

    def timed(f, into: int):  # adds f's thread CPU time to spent[into]
        def call(*args, **kwargs):
            t0 = time.thread_time()
            out = f(*args, **kwargs)
            spent[into] += time.thread_time() - t0
            return out
        return call

    sched.schedule = timed(sched.schedule, 0)
    sched.update_from_output = timed(sched.update_from_output, 0)
    for name in HOOKS if sched.connector is not None else ():
        if hasattr(sched.connector, name):
            setattr(sched.connector, name, timed(getattr(sched.connector, name), 2))
    if sched.connector is not None:  # the metadata sent to the workers, and what they send back
        for name in ("build_connector_meta", "update_connector_output"):
            hook = getattr(sched.connector, name)
            setattr(sched.connector, name, lambda arg, _hook=hook, _name=name: crossed(_hook, arg, _name, spent[3]))
    return spent


def crossed(hook, arg, name: str, into: list):
    """hook(arg), keeping what crosses processes as (received, object): the metadata it returns
    (sent to the workers), the workers' output it gets."""
    out = hook(arg)
    into.append((False, out) if name == "build_connector_meta" else (True, arg))
    return out


def wire(crossings: list) -> tuple[float, int]:
    """(the engine core's CPU seconds, bytes) of a pass's crossings: vLLM pickles the scheduler
    output (the connector's metadata in it) in the engine core, which unpickles every worker's
    output (KVConnectorOutput). Timed after the pass, each object alone."""
    seconds, size = 0.0, 0
    for received, obj in crossings:
        blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        t0 = time.thread_time()
        pickle.loads(blob) if received else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        seconds += time.thread_time() - t0
        size += len(blob)
    return seconds, size


def timed_pass(h, spent: list, prompts) -> tuple[tuple[float, int, float, float, int], int]:
    """One pass of `prompts` (2 tokens each) through harness `h` to the end: ((CPU seconds, steps,
    of which in the connector's hooks, the engine core's CPU seconds and bytes for what crossed
    processes), tokens served by the prefix cache and tiers)."""
    spent[:] = [0.0, 0, 0.0, []]
    ids = [h.add(p, max_tokens=2) for p in prompts]
    while h.scheduler.has_unfinished_requests():
        h.step()
        spent[1] += 1
    return (*spent[:3], *wire(spent[3])), sum(h.cached_tokens[r] for r in ids)


def workload(n: int, seed: int = 0) -> list[list[int]]:
    return shared_prefix_workload(n, systems=4, system_len=(300, 2000), body_len=(200, 6000), max_len=8000,
                                  seed=seed)


def run(geometry: dict, prompts, with_connector: bool) -> dict:
    """{pass: (scheduler CPU seconds, steps)} and the tokens the tier served in the hit pass."""
    connector = {"cpu_bytes_to_use": 3 << 30} if with_connector else None
    h = SchedulerHarness(HarnessConfig(max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=16,
                                       connector=connector, **geometry))
    spent = timed_scheduler(h.scheduler)
    result = {}
    for name in ("store", "hit"):
        if name == "hit":
            if h.workers:
                h.settle()
            h.reset_prefix_cache()
        result[name], result[f"{name}_served"] = timed_pass(h, spent, prompts)
        if name == "store":  # the pause a full collection makes now, walking what the run left
            t0 = time.thread_time()
            gc.collect()
            result["collect"] = time.thread_time() - t0
            result["tracked"] = len(gc.get_objects())
    gc.unfreeze()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--native", action="store_true", help="only the table of the five stacks (native_table)")
    ap.add_argument("--geometry", default="", help="with --native: only geometries whose name contains this")
    args = ap.parse_args()
    prompts = workload(args.requests)
    print(f"{args.requests} requests, {sum(map(len, prompts)) / 1e6:.2f}M prompt tokens, 2 output tokens each; "
          f"vLLM {vllm.__version__}, load average {os.getloadavg()[0]:.2f}")
    if args.native:
        return native_table(prompts, args.reps, args.geometry)
    for name, geometry in GEOMETRIES.items():
        runs = {False: [], True: []}
        for _ in range(args.reps):
            for with_connector in (False, True):
                runs[with_connector].append(run(geometry, prompts, with_connector))
        collect = {w: min(r["collect"] for r in rs) for w, rs in runs.items()}
        tracked = {w: rs[0]["tracked"] for w, rs in runs.items()}
        print(f"{name}: a full garbage collection after the store pass takes {collect[False] * 1e3:.1f} ms "
              f"without a connector ({tracked[False]} objects tracked), {collect[True] * 1e3:.1f} ms with "
              f"KVBMConnector ({tracked[True]}; its CPU tier holds the stored blocks)")
        for p in ("store", "hit"):
            best = {w: min(r[p][0] for r in rs) for w, rs in runs.items()}
            hooks = min(r[p][2] for r in runs[True])
            steps = {w: rs[0][p][1] for w, rs in runs.items()}
            served = runs[True][0][f"{p}_served"]
            print(f"{name}, {p} pass: scheduler {best[False] * 1e3:.0f} ms in {steps[False]} steps without a "
                  f"connector, {best[True] * 1e3:.0f} ms in {steps[True]} steps with KVBMConnector -> "
                  f"{best[True] / best[False]:.3f}x; its hooks {hooks * 1e3:.0f} ms -> (none + hooks) / none "
                  f"{(best[False] + hooks) / best[False]:.3f}x (tokens served by the prefix cache and tier: {served})")


# --- vLLM's own OffloadingConnector on the same workload (issue 29 item 5) ---
STACKS = ("none", "a connector that does nothing", "KVBMConnector", "OffloadingConnector+vLLM spec",
          "OffloadingConnector+KVBMOffloadingSpec")


class NullHarness(SchedulerHarness):
    """vLLM's Scheduler with null_connector.NullConnector: vLLM's own cost of having a connector."""

    def _kv_transfer_config(self):
        from vllm.config import KVTransferConfig

        return KVTransferConfig(kv_connector="NullConnector", kv_connector_module_path="null_connector",
                                kv_role="kv_both")

    def _workers(self, kv_cache_config) -> list:
        return []


def run_null(geometry: dict, prompts) -> dict:
    """run()'s passes with a connector that does nothing (never a hit: the hit pass recomputes)."""
    h = NullHarness(HarnessConfig(max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=16, **geometry))
    spent = timed_scheduler(h.scheduler)
    result = {}
    for name in ("store", "hit"):
        if name == "hit":
            h.reset_prefix_cache()
        result[name], result[f"{name}_served"] = timed_pass(h, spent, prompts)
    gc.unfreeze()
    return result


def run_native(geometry: dict, prompts, kvbm_spec: bool) -> dict:
    """run()'s passes with vLLM's OffloadingConnector as the scheduler's connector: vLLM's default
    CPUOffloadingSpec or KVBMOffloadingSpec (LineageCachePolicy), a CPU tier of 1 GiB, the same
    KV cache groups (one state group and one attention group for the hybrid). vLLM's worker role
    runs each step's copies (testing.offloading_scheduler), untimed, without the KV oracle."""
    from vllm_kvbm_plugin.testing.offloading_scheduler import OffloadingHarness, OffloadingHarnessConfig

    h = OffloadingHarness(OffloadingHarnessConfig(
        max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=16, mamba_layers=1, oracle=False,
        kvbm_spec=kvbm_spec, offloading={"cpu_bytes_to_use": 1 << 30}, **geometry))
    spent = timed_scheduler(h.scheduler)
    result = {}
    try:
        for name in ("store", "hit"):
            if name == "hit":
                h.settle()
                h.reset_prefix_cache()
            result[name], result[f"{name}_served"] = timed_pass(h, spent, prompts)
    finally:
        gc.unfreeze()
        h.close()
    return result


def native_table(prompts, reps: int, only: str = "") -> None:
    """The stacks (STACKS) on each geometry (whose name contains `only`), runs alternating, best of
    `reps` each: scheduler ms per pass, ms per step, and the ratio to no connector."""
    for name, geometry in GEOMETRIES.items():
        if only not in name:
            continue
        runs = {s: [] for s in STACKS}
        for _ in range(reps):
            runs["none"].append(run(geometry, prompts, False))
            runs["a connector that does nothing"].append(run_null(geometry, prompts))
            runs["KVBMConnector"].append(run(geometry, prompts, True))
            runs["OffloadingConnector+vLLM spec"].append(run_native(geometry, prompts, False))
            runs["OffloadingConnector+KVBMOffloadingSpec"].append(run_native(geometry, prompts, True))
        for p in ("store", "hit"):
            none = min(r[p][0] for r in runs["none"])
            print(f"{name}, {p} pass (best of {reps}; scheduler CPU, ms per step, ratio to none; the "
                  f"connector's own hooks, (none + hooks) / none):")
            for stack, rs in runs.items():
                best_s, steps, hooks = min(r[p][0] for r in rs), rs[0][p][1], min(r[p][2] for r in rs)
                wire_s, wire_bytes = min(r[p][3] for r in rs), rs[0][p][4]
                print(f"  {stack:40s} {best_s * 1e3:8.0f} ms {steps:5d} steps {best_s * 1e3 / steps:7.2f} ms/step "
                      f"{best_s / none:6.2f}x  hooks {hooks * 1e3:5.0f} ms {(none + hooks) / none:5.2f}x  "
                      f"wire {wire_s * 1e3:4.0f} ms {wire_bytes / 2**20:5.1f} MiB  served {rs[0][f'{p}_served']}")


if __name__ == "__main__":
    main()
