"""Sub-sequence probe vs our key hashing of the same request. Target: ratio <= 1.

The index holds `--stored` units (documents stored behind random preambles, as a RAG server's
tiers would); each request is a new preamble plus some of those documents in another order, so
most of its windows hit. Probe = `SubseqIndex.find` (rolling hash of every window, table probe,
token check, runs, metrics); hashing = `hashing.request_keys` (what the connector computes for
every request anyway).

    python benchmarks/bench_subseq.py [--tokens 32768] [--unit 32] [--stored 100000] [--repeat 20]
"""

import argparse
import random

import numpy as np

from vllm_kvbm_plugin.hashing import Keyer
from vllm_kvbm_plugin.reuse.subseq import SubseqIndex

from timing import best

KEYER = Keyer(bytes(range(16)))  # any secret: the timing does not depend on it
request_keys = KEYER.request_keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--unit", type=int, default=32)
    ap.add_argument("--stored", type=int, default=100_000, help="units in the index")
    ap.add_argument("--doc", type=int, default=400, help="document length in tokens")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    unit = args.unit
    index = SubseqIndex(unit, capacity=args.stored)
    docs = []
    n_units = 0
    while n_units < args.stored:  # stored sequences: preamble + 8 documents
        seq_docs = [rng.integers(0, 150000, args.doc) for _ in range(8)]
        docs.extend(seq_docs)
        seq = np.concatenate([rng.integers(0, 150000, rng.integers(0, 200))] + seq_docs)
        parent = None
        for i in range(len(seq) // unit):
            key = (n_units, i)
            index.add(key, seq[i * unit:(i + 1) * unit], parent)
            parent = key
            n_units += 1
    pick = random.Random(1)
    parts = [rng.integers(0, 150000, 300)]
    while sum(map(len, parts)) < args.tokens:
        parts.append(docs[pick.randrange(len(docs))])
    request = np.concatenate(parts)[:args.tokens].astype(np.int64)
    root = KEYER.root("bench", "bfloat16", "LBHNC", unit)

    fresh = rng.integers(0, 150000, args.tokens).astype(np.int64)  # a request nothing holds
    print(f"{args.tokens} tokens, unit {unit}, {len(index)} units stored, table {len(index.tab)} buckets")
    for name, req in (("RAG request (stored documents, reordered)", request), ("request with no reuse", fresh)):
        tokens = req.tolist()
        m = index.find(tokens)  # compile / load the cached kernels
        request_keys(tokens, unit, root)
        t_probe = best(args.repeat, lambda: index.find(tokens))
        t_keys = best(args.repeat, lambda: request_keys(tokens, unit, root))
        t_probe_arr = best(args.repeat, lambda: index.find(req))
        t_keys_arr = best(args.repeat, lambda: request_keys(req, unit, root))
        print(f"{name}: {len(m.runs)} runs, prefix {m.prefix_tokens}, reusable non-prefix "
              f"{m.reusable_tokens} tokens, rejected {m.rejected}")
        print(f"  token list in:  probe {t_probe * 1e3:7.3f} ms, request_keys {t_keys * 1e3:7.3f} ms, "
              f"ratio {t_probe / t_keys:5.2f} (target <= 1)")
        print(f"  int64 array in: probe {t_probe_arr * 1e3:7.3f} ms, request_keys {t_keys_arr * 1e3:7.3f} ms, "
              f"ratio {t_probe_arr / t_keys_arr:5.2f}")


if __name__ == "__main__":
    main()
