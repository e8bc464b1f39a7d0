"""vllm-kvbm-plugin: a KV-cache companion for vLLM (events at hash granularity, KV tiers)."""

__version__ = "0.2.0"
