"""vllm-kvbm-plugin: a KV-cache companion for vLLM (events at hash granularity, KV tiers)."""

__version__ = "0.1.0"
