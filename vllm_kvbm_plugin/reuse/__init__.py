"""Reuse of KV that is not a prefix (issue 12): `subseq_index` finds where stored hash units occur
in a new request at any offset (its numba kernels: `subseq_kernels`; fed from KV events:
`subseq_feed`), `rope` re-rotates stored K to new positions, `cpu_layout` views K and V inside
vLLM's CPU attention KV cache. Pure: no vLLM import."""
