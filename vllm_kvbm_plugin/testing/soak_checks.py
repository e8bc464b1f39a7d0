"""What keeps benchmarks/soak.py from passing a soak that proves nothing: each tier must have served
hits (a connector that never serves anything compares equal to the reference on every token), and
a negative control must be caught (a forged disk block whose header verifies, served on purpose,
must show up as a mismatch, or the token comparison could not see a wrong block either)."""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from vllm_kvbm_plugin.tiers import block_file
from vllm_kvbm_plugin.tiers.mac import mac_key

TIERS = ("cpu", "disk", "remote")


class Check(NamedTuple):
    """One acceptance line of the soak's report."""

    name: str
    passed: bool
    detail: object


class Control(NamedTuple):
    """The negative control's outcome: a prompt whose disk blocks were forged, sent after a restart."""

    forged: int  # block files of its prompt forged
    cached: int  # prompt tokens its request got from the tiers
    mismatched: bool  # its greedy tokens differ from the reference's


def served_blocks(blocks: dict[tuple[str, str], float]) -> dict[str, float]:
    """Blocks each tier served, from vllm:kvbm_blocks_total by (tier, direction): CPU slot -> KV
    cache loads, verified disk reads (prefetches and direct loads), verified remote reads. The CPU
    figure includes blocks staged there from disk or Redis: the metrics do not tell them apart (the
    dashboard's "less prefetches and remote reads" came out at -8 in a soak: not every remote read
    is loaded)."""
    return {"cpu": blocks.get(("cpu", "load"), 0.0), "disk": blocks.get(("disk", "read"), 0.0),
            "remote": blocks.get(("remote", "read"), 0.0)}


def tier_checks(served: dict[str, float]) -> list[Check]:
    return [Check(f"the {t} tier served hits", served.get(t, 0) > 0, f"{served.get(t, 0):.0f} blocks")
            for t in TIERS]


def control_check(control: Control | None, allow_off: bool = False) -> Check:
    """Passes only when the forged blocks were loaded and their request mismatched; a soak run
    without its control fails unless allow_off (local experiments)."""
    name = "negative control: a forged disk block served on purpose is caught as a mismatch"
    if control is None:
        why = "allowed by --allow-no-control" if allow_off else "a soak without a working control proves nothing"
        return Check(name, allow_off, f"off (--no-negative-control): {why}")
    ok = control.forged > 0 and control.cached > 0 and control.mismatched
    return Check(name, ok, f"{control.forged} block files forged, {control.cached} prompt tokens loaded, "
                           f"{'mismatch seen (expected)' if control.mismatched else 'NO mismatch seen'}")


def forge_block(path: str, secret: bytes, itemsize: int) -> None:
    """Rewrite the block file at `path` through the disk tier's own writer with the sign of every
    KV value flipped (values of `itemsize` bytes, little-endian): same key, layout fingerprint and
    metadata, a header that verifies (its MAC made under `secret`, the tier secret: the soak's
    KVBM_KEY_SECRET), KV that surely changes greedy tokens."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    h = block_file.parse_header(data)
    if h is None or len(data) != block_file.HEADER_SIZE + h.payload_bytes + h.meta_bytes:
        raise ValueError(f"{path} is not a block file of this format version")
    payload = np.frombuffer(data, np.uint8, h.payload_bytes, block_file.HEADER_SIZE).copy()
    payload.reshape(-1, itemsize)[:, itemsize - 1] ^= 0x80
    key = (int.from_bytes(h.key[:8], "big"), int.from_bytes(h.key[8:], "big"))
    block_file.write_block(path, key, h.fingerprint, mac_key(secret), payload, data[block_file.HEADER_SIZE + h.payload_bytes:])
