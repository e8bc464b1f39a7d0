"""Follow vLLM's KV event stream like a router would: subscribe, recover gaps, validate.

    python examples/subscriber.py tcp://127.0.0.1:5557 tcp://127.0.0.1:5558

Start vLLM with --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",
"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv"}'. Needs only pyzmq and
msgspec on this host (no vLLM).
"""

import sys

from vllm_kvbm_plugin.events.subscriber import Subscriber
from vllm_kvbm_plugin.events.types import BlockRemoved, BlockStored, tier_of
from vllm_kvbm_plugin.events.validator import Validator


def main(endpoint: str, replay: str | None) -> None:
    validator = Validator()
    with Subscriber(endpoint, replay, topic="kv") as sub:
        try:
            for seq, batch in sub.iter():
                validator.apply(batch, seq)
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        print(f"#{seq} stored {len(ev.block_hashes)} x {ev.block_size} tokens "
                              f"group {ev.group_idx} ({ev.kv_cache_spec_kind}) on {tier_of(ev).label}")
                    elif isinstance(ev, BlockRemoved):
                        print(f"#{seq} removed {len(ev.block_hashes)} from group {ev.group_idx} "
                              f"on {tier_of(ev).label}")
                    else:
                        print(f"#{seq} all blocks cleared")
        except KeyboardInterrupt:
            pass
        report = validator.report()
        print(f"stats: {sub.stats}; validator: {validator.errors} errors, {report['by_rule']}; "
              f"tiers: {report['tiers']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5557",
         sys.argv[2] if len(sys.argv) > 2 else None)
