"""KV event tools that run without vLLM: wire types, subscriber, validator."""
