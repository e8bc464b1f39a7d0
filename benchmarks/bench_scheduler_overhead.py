"""Scheduler step time with the plugin's sub-block events over vanilla vLLM, same run, same workload.

vLLM's real Scheduler runs in-process with a hybrid KV cache config (a Mamba group and a full-attention
group sharing an inflated block) and simulated model outputs. KV events are on in both runs; the
vanilla run has every patch removed. After a warm-up pair, runs alternate (vanilla, plugin, ...).
Every run of one workload takes the same steps, so "best" is per step: each step's least CPU time
over the runs, summed (whole runs on a shared or virtual machine differ by up to a third, which
the best of a few whole runs cannot remove); "median" is the median run. The spread of whole
runs is printed. Published batches are counted and dropped,
as vLLM's publisher thread does (retaining them would bill garbage-collector work to the run with
more events). Then a lockstep measure: a vanilla and a plugin scheduler on the same workload,
stepped alternately (patches switched between steps, which of the two goes first swapped every
step: the second of a pair runs ~4% faster), so load from other processes on a shared machine
hits both alike; its ratio is the sum of plugin step times over the sum of vanilla ones.
Target: <= 1.05x best for 2176/64.

`--tracker` measures the plugin's own bookkeeping alone, with little noise: the calls into the
sub-block event tracker (`UnitTracker`) of one plugin run are recorded, then replayed on fresh
trackers with the garbage collector off; printed is the best replay against the scheduler CPU
time of an unrecorded plugin run. Use it to judge a change to the tracker in seconds: `--against
OLD.py` (e.g. `git show HEAD:vllm_kvbm_plugin/events/unit_tracker.py > /tmp/old.py`; a
patches/sub_block_events.py from before the tracker moved out works too) replays that copy's
tracker on the same calls, the two taking turns, and checks both build the same events;
then it steps two plugin schedulers in lockstep, one with each tracker (`--lockstep-reps` times):
in place the tracker costs ~1.5x its replay (cache misses); A/A reads 0.996-1.000x (2176/64), 0.97-0.99x (160/32).

    python benchmarks/bench_scheduler_overhead.py [--requests 1000] [--reps 5] [--lockstep-reps 3]
                                                  [--tracker [--against OLD.py]]
"""

import argparse
import gc
import os
import statistics
import time

import vllm

from vllm_kvbm_plugin import patches, plugin
from vllm_kvbm_plugin.testing.scheduler import HarnessConfig, SchedulerHarness

from timing import shared_prefix_workload

GEOMETRIES = {"nemotron-like (2176/64)": (2176, 64), "tiny qwen3-next (160/32)": (160, 32)}


def workload(n: int, seed: int = 0) -> list[list[int]]:
    return shared_prefix_workload(n, systems=8, system_len=(500, 3000), body_len=(1000, 16000), max_len=16000,
                                  seed=seed)


def use_plugin(with_plugin: bool) -> None:
    if with_plugin:
        patches.apply_all()
    else:
        patches.remove_all()


def harness(block: int, unit: int) -> SchedulerHarness:
    return SchedulerHarness(HarnessConfig(block_size=block, hash_block_size=unit, num_blocks=600,
                                          max_model_len=16384, max_num_batched_tokens=8192,
                                          max_num_seqs=32))


def run_once(block: int, unit: int, prompts, with_plugin: bool) -> tuple[list[float], int, float]:
    """CPU time of each scheduler step, the number of KV events published, and the CPU time of
    adding the requests (vLLM hashes them then; with the plugin their hashes are also converted to
    event form, which an engine does in its input thread, outside the step)."""
    use_plugin(with_plugin)
    h = harness(block, unit)
    n_events = 0

    def publish(batch) -> None:  # like vLLM's publisher thread: encode and forget, never retain
        nonlocal n_events
        n_events += len(batch.events)

    h.scheduler.kv_event_publisher.publish = publish
    gc.collect()  # the previous run's garbage is not this run's admission cost
    t0 = time.process_time()
    for p in prompts:
        h.add(p, max_tokens=2)
    adding = time.process_time() - t0
    times = []
    while h.scheduler.has_unfinished_requests():
        t0 = time.process_time()
        h.step()
        times.append(time.process_time() - t0)
    return times, n_events, adding


def lockstep(harnesses: dict, before_step=lambda key: None) -> dict:
    """Each harness's scheduler CPU time, the schedulers stepped alternately until all are done;
    which goes first is swapped every step (the second of a pair runs ~4% faster: warm caches)."""
    total = dict.fromkeys(harnesses, 0.0)
    order = list(harnesses)
    while any(h.scheduler.has_unfinished_requests() for h in harnesses.values()):
        order.reverse()
        for key in order:
            before_step(key)
            t0 = time.process_time()
            harnesses[key].step()
            total[key] += time.process_time() - t0
    return total


def loaded(block: int, unit: int, prompts) -> SchedulerHarness:
    """A harness holding the workload, publishing nowhere (events counted by nobody)."""
    h = harness(block, unit)
    h.scheduler.kv_event_publisher.publish = lambda batch: None
    for p in prompts:
        h.add(p, max_tokens=2)
    return h


def lockstep_once(block: int, unit: int, prompts) -> float:
    """Plugin over vanilla CPU time, both schedulers stepped alternately on the same workload."""
    runs = {}
    for with_plugin in (False, True):
        use_plugin(with_plugin)
        runs[with_plugin] = loaded(block, unit, prompts)
    total = lockstep(runs, use_plugin)
    return total[True] / total[False]


def tracker_in_place(block: int, unit: int, prompts, against) -> float:
    """Scheduler CPU time with our UnitTracker over `against`'s, in place (cache effects
    included, which a replay misses): two plugin schedulers, one tracker each, in lockstep."""
    use_plugin(True)
    runs = {}
    for cls in (against, None):
        h = runs[cls] = loaded(block, unit, prompts)
        if cls is not None:
            pool = h.scheduler.kv_cache_manager.block_pool
            t = pool._kvbm_units
            pool._kvbm_units = cls(pool, t.units_per_block, t.coarse)
    total = lockstep(runs)
    return total[None] / total[against]


class _BlockSnapshot:
    """What the tracker reads of a KVCacheBlock, as it was at the call."""

    __slots__ = ("block_id", "is_null")

    def __init__(self, block):
        self.block_id, self.is_null = block.block_id, block.is_null


def tracker_replay(block: int, unit: int, prompts, reps: int, against=None) -> tuple[dict, float, int]:
    """({"ours": best replay seconds[, "against": ...]}, a plugin run's scheduler CPU seconds,
    calls) of UnitTracker; with `against` (another UnitTracker class, e.g. an older version) both
    replay the same calls alternately, the order swapped every round, and must build the same events."""
    from vllm_kvbm_plugin.events.unit_tracker import UnitTracker

    scheduler = sum(run_once(block, unit, prompts, True)[0])  # not recorded: recording costs

    calls, recorded = [], []  # calls: (tracker.recent_tokens, method name, args); recorded: the tracker
    names = ("cache", "cache_partial", "release", "flush_removed")
    originals = {name: UnitTracker.__dict__[name] for name in names}

    def recorder(name):
        def record(self, *args, **kwargs):
            args += tuple(kwargs.values())  # the tracker's methods take their arguments in order
            if name == "cache":  # the blocks as they were at the call
                args = (*args[:2], [_BlockSnapshot(b) for b in args[2]], *args[3:])
            elif name == "cache_partial":
                args = (*args[:2], _BlockSnapshot(args[2]), *args[3:])
            calls.append((self.recent_tokens, name, args))
            recorded[:] = [self]
            return originals[name](self, *args)
        return record

    for name in names:
        setattr(UnitTracker, name, recorder(name))
    try:
        run_once(block, unit, prompts, True)
    finally:
        for name, f in originals.items():
            setattr(UnitTracker, name, f)
    recorded = recorded[0]
    pool = recorded.pool

    def replay(cls) -> tuple[float, list]:
        t = cls(pool, recorded.units_per_block, recorded.coarse)
        methods = {name: getattr(t, name) for name in names}
        pool.kv_event_queue = []
        gc.disable()
        t0 = time.process_time()
        for recent, name, args in calls:
            t.recent_tokens = recent
            methods[name](*args)
        seconds = time.process_time() - t0
        gc.enable()
        return seconds, pool.kv_event_queue

    contenders = {"ours": UnitTracker} | ({"against": against} if against is not None else {})
    if against is not None:
        ours, theirs = replay(UnitTracker)[1], replay(against)[1]
        assert ours == theirs, "the two trackers build different events"
    best = dict.fromkeys(contenders, float("inf"))
    for i in range(reps):
        for name, cls in list(contenders.items())[:: 1 if i % 2 else -1]:
            best[name] = min(best[name], replay(cls)[0])
    return best, scheduler, len(calls)


def load_tracker(path: str):
    """The UnitTracker class of another copy of events/unit_tracker.py (or of
    patches/sub_block_events.py from before the tracker left it), e.g. from git show."""
    import importlib.util

    from vllm_kvbm_plugin.patches.sub_block_events import vllm_event_api

    spec = importlib.util.spec_from_file_location("kvbm_unit_tracker_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = module.UnitTracker
    if getattr(cls, "vllm", False) is None:  # a copy of events/unit_tracker.py: bound as the patch binds ours
        cls.vllm = vllm_event_api()
    return cls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lockstep-reps", type=int, default=3)
    ap.add_argument("--tracker", action="store_true", help="only replay the tracker's recorded calls")
    ap.add_argument("--against", metavar="FILE", help="with --tracker: also replay the UnitTracker of this copy "
                    "of events/unit_tracker.py, alternately, and check both build the same events")
    args = ap.parse_args()
    prompts = workload(args.requests)
    if args.tracker or args.against:
        against = load_tracker(args.against) if args.against else None
        reps = max(args.reps, 5)
        for name, (block, unit) in GEOMETRIES.items():
            best, sched, n = tracker_replay(block, unit, prompts, reps, against)
            print(f"{name}: UnitTracker alone {best['ours'] * 1e3:.1f} ms (best of {reps} replays of {n} calls) = "
                  f"{best['ours'] / sched:.1%} of a plugin run's scheduler CPU time ({sched * 1e3:.0f} ms)")
            if against is not None:
                print(f"{name}: against {args.against}: {best['against'] * 1e3:.1f} ms, same events; "
                      f"ours/against {best['ours'] / best['against']:.3f}x")
                ratios = [tracker_in_place(block, unit, prompts, against) for _ in range(args.lockstep_reps)]
                if ratios:
                    print(f"{name}: in place (scheduler CPU time, two plugin schedulers in lockstep), "
                          "ours/against " + " ".join(f"{r:.3f}x" for r in ratios))
        return
    print(f"{args.requests} requests, {sum(map(len, prompts)) / 1e6:.1f}M prompt tokens, 2 output tokens each; "
          f"vLLM {vllm.__version__}, load average {os.getloadavg()[0]:.2f} (other processes make ratios noisy)")
    for name, (block, unit) in GEOMETRIES.items():
        runs = {False: [], True: []}  # per run: each step's CPU time
        adding = {False: [], True: []}  # per run: CPU time of adding the requests
        info = {}
        for with_plugin in (False, True):  # warm-up
            run_once(block, unit, prompts[:100], with_plugin)
        for _ in range(args.reps):
            for with_plugin in (False, True):
                times, n_events, added = run_once(block, unit, prompts, with_plugin)
                runs[with_plugin].append(times)
                adding[with_plugin].append(added)
                info[with_plugin] = (len(times), n_events)
        assert len({len(t) for r in runs.values() for t in r}) == 1, "runs took different steps"
        steps = info[False][0]
        best = {w: sum(map(min, zip(*r))) / steps for w, r in runs.items()}  # per-step minimum
        mean = {w: [sum(t) / steps for t in r] for w, r in runs.items()}  # per run
        med = statistics.median(mean[True]) / statistics.median(mean[False])
        paired = [p / v for v, p in zip(mean[False], mean[True])]  # each rep's plugin over its vanilla
        print(f"{name}: vanilla {best[False] * 1e3:.3f} ms/step ({steps} steps, {info[False][1]} events), "
              f"plugin {best[True] * 1e3:.3f} ms/step ({info[True][1]} events) -> ratio "
              f"{best[True] / best[False]:.3f}x best, {med:.3f}x median")
        print(f"{name}: spread (noise from other processes): vanilla runs "
              f"{min(mean[False]) * 1e3:.3f}-{max(mean[False]) * 1e3:.3f} ms/step, paired ratios "
              f"{min(paired):.3f}-{max(paired):.3f}x")
        print(f"{name}: adding the requests (vLLM hashes them) {min(adding[False]) * 1e3:.0f} ms vanilla, "
              f"{min(adding[True]) * 1e3:.0f} ms plugin (best of {args.reps})")
        if args.lockstep_reps:
            ratios = [lockstep_once(block, unit, prompts) for _ in range(args.lockstep_reps)]
            print(f"{name}: lockstep ratio {min(ratios):.3f}x best, {statistics.median(ratios):.3f}x median "
                  f"(all: {' '.join(f'{r:.3f}' for r in ratios)})")
    plugin.register()


if __name__ == "__main__":
    main()
