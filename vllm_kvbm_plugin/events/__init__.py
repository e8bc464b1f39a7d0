"""KV events: vLLM's wire format, reading and checking streams, the router-side index, and the
bookkeeping behind the plugin's per-unit events.

Pure (no vLLM import; numpy, numba, msgspec, pyzmq at most), usable by a router or a test alone:
- `types`: msgspec mirrors of vLLM's KV event wire types, tiers (`Tier`), `SPARSE_KINDS`;
- `subscriber`: ZMQ subscriber of a vLLM event stream, with gap detection and replay;
- `recording`: streams recorded as JSON lines, and read back;
- `validator`: a router-like index of a stream that reports every inconsistency (`vllm-kvbm validate`);
- `index`: `KVIndex`, what each worker of a fleet will serve of a prompt (`vllm-kvbm route`);
- `prompt_hashes`: vLLM's block hashes and extra keys of a prompt, reproduced (`PromptHasher`);
- `unit_tracker`: `UnitTracker`, which hash units each physical block holds and the events that
  follow; runs inside vLLM's scheduler, but vLLM's event classes are handed to it by
  patches/sub_block_events.py, so it imports none.

Needs vLLM: `announcer` (`vllm-kvbm announce`: the remote tier's events, published with vLLM's own
ZmqEventPublisher and event classes, imported inside the functions that publish; and redis).
"""
