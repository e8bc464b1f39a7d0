"""Recorded KV event streams as JSON lines: `{"seq": N, "batch": {...}}` per batch.

Batches are written in the plain JSON form of `types.to_jsonable` (events tagged with "type",
bytes hashes as hex strings) and read back into `KVEventBatch`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import IO

import msgspec

from vllm_kvbm_plugin.events.types import KVEventBatch, to_jsonable


def dump_line(seq: int, batch: KVEventBatch) -> str:
    return json.dumps({"seq": seq, "batch": to_jsonable(batch)}, separators=(",", ":"))


def write(fp: IO[str], records: Iterable[tuple[int, KVEventBatch]]) -> None:
    for seq, batch in records:
        fp.write(dump_line(seq, batch) + "\n")


def read(fp: IO[str]) -> Iterator[tuple[int, KVEventBatch]]:
    for lineno, line in enumerate(fp, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            for ev in rec["batch"][1]:  # batches are arrays: [ts, events, dp_rank]
                _unhex(ev)
            batch = msgspec.convert(rec["batch"], KVEventBatch)
        except (ValueError, KeyError, TypeError, msgspec.ValidationError) as e:
            raise ValueError(f"line {lineno}: not a recorded KV event batch: {e}") from e
        yield rec.get("seq"), batch


def _unhex(ev: dict) -> None:
    hashes = ev.get("block_hashes")
    if hashes and isinstance(hashes[0], str):
        ev["block_hashes"] = [bytes.fromhex(h) for h in hashes]
    if isinstance(ev.get("parent_block_hash"), str):
        ev["parent_block_hash"] = bytes.fromhex(ev["parent_block_hash"])
