"""Tier machinery without vLLM: eviction policies, the tier index, the block file format and its
directories, the remote values and their Redis clients, secrets and MACs, unit-tested in
milliseconds. No torch either, except the copies between the KV cache and the pool and the pool's
memory: `transfer`, `roofline` and `host_memory` import torch."""
