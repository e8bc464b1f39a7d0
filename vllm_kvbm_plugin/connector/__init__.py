"""vLLM KV connector `KVBMConnector` (module path `vllm_kvbm_plugin.connector`).

vLLM imports this module in the API server too (capability checks): keep the import cheap; the
scheduler and worker sides are imported when the connector is built.
"""

from vllm_kvbm_plugin.connector.connector import KVBMConnector

__all__ = ["KVBMConnector"]
