"""Offline vLLM with KVBMConnector: a prompt, a prefix-cache reset, the same prompt served from the
CPU tier, then a new engine process would find it on disk.

    python examples/offload_llm.py [MODEL_DIR] [DISK_DIR]

Without MODEL_DIR a tiny local Llama is built (no model hub). On a CPU-only box set
VLLM_CPU_KVCACHE_SPACE (GiB) to cap vLLM's own KV cache.
"""

import os
import sys
import tempfile


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_kvbm_plugin.testing import tiny_models

    model = sys.argv[1] if len(sys.argv) > 1 else str(tiny_models.build("llama"))
    disk = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="kvbm-disk-")
    llm = LLM(model=model, max_model_len=1024, block_size=32, enforce_eager=True, enable_prefix_caching=True,
              kv_transfer_config={
                  "kv_connector": "KVBMConnector",
                  "kv_connector_module_path": "vllm_kvbm_plugin.connector",
                  "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute",  # a disk block failing its load is a miss
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20, "disk_path": disk,
                                                "disk_bytes_to_use": 1 << 30, "eviction_policy": "lineage"},
              })
    prompt = [TokensPrompt(prompt_token_ids=list(range(100, 400)))]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    first = llm.generate(prompt, greedy, use_tqdm=False)[0]
    llm.reset_prefix_cache()  # vLLM forgets; the CPU tier does not
    again = llm.generate(prompt, greedy, use_tqdm=False)[0]
    print(f"first run: {first.num_cached_tokens} cached tokens; after reset: {again.num_cached_tokens} "
          f"from the tier; identical output: {first.outputs[0].token_ids == again.outputs[0].token_ids}")
    print(f"disk tier: {disk} (run again with this directory: a new process hits on disk)")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()
