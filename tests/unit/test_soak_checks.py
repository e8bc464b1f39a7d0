"""The soak's self-checks (testing/soak_checks.py): a report whose tiers served nothing, whose
negative control was not caught, or that ran without one fails; the forged block verifies."""

import numpy as np

from vllm_kvbm_plugin.testing.soak_checks import Control, control_check, forge_block, served_blocks, tier_checks
from vllm_kvbm_plugin.tiers import block_dir, block_file
from vllm_kvbm_plugin.tiers.mac import mac_key

BLOCKS = {("cpu", "store"): 80.0, ("cpu", "load"): 50.0, ("disk", "write"): 70.0, ("disk", "read"): 10.0,
          ("disk", "load"): 4.0, ("remote", "write"): 60.0, ("remote", "read"): 5.0}


def test_served_blocks_per_tier():
    assert served_blocks(BLOCKS) == {"cpu": 50.0, "disk": 10.0, "remote": 5.0}
    assert all(c.passed for c in tier_checks(served_blocks(BLOCKS)))


def test_a_tier_that_served_nothing_fails():
    stores_only = {k: v for k, v in BLOCKS.items() if k[1] in ("store", "write")}
    assert [c.passed for c in tier_checks(served_blocks(stores_only))] == [False, False, False]
    no_remote = {**BLOCKS, ("remote", "read"): 0.0}
    assert [(c.name, c.passed) for c in tier_checks(served_blocks(no_remote))] == [
        ("the cpu tier served hits", True), ("the disk tier served hits", True),
        ("the remote tier served hits", False)]
    assert not tier_checks({})[0].passed


def test_negative_control_must_be_caught():
    assert control_check(Control(forged=9, cached=288, mismatched=True)).passed
    assert not control_check(Control(forged=9, cached=288, mismatched=False)).passed  # not detected
    assert not control_check(Control(forged=9, cached=0, mismatched=True)).passed  # never loaded
    assert not control_check(Control(forged=0, cached=288, mismatched=True)).passed  # nothing forged


def test_control_off_fails_unless_allowed():
    assert not control_check(None).passed
    assert control_check(None, allow_off=True).passed


def test_forged_block_verifies_with_every_sign_flipped(tmp_path):
    fp, key, secret = bytes(range(16)), (7 << 40, 3), bytes(range(16, 32))
    mk = mac_key(secret)
    values = np.linspace(-2, 2, 1024, dtype=np.float32)
    path = block_dir.block_path(block_dir.block_dir(str(tmp_path), fp, 0), key)
    block_file.write_block(path, key, fp, mk, values.view(np.uint8), b"meta")
    forge_block(path, secret, 4)
    out = np.empty(values.nbytes, dtype=np.uint8)
    assert block_file.read_into(path, key, fp, mk, out) == b"meta"
    np.testing.assert_array_equal(out.view(np.float32), -values)
    half = np.linspace(-2, 2, 512, dtype=np.float16)
    block_file.write_block(path, key, fp, mk, half.view(np.uint8))
    forge_block(path, secret, 2)
    out = np.empty(half.nbytes, dtype=np.uint8)
    assert block_file.read_into(path, key, fp, mk, out) == b""
    np.testing.assert_array_equal(out.view(np.float16), -half)
