"""A real engine on a disk_path holding every kind of foreign content (issue 9 part 5) starts in its
usual time, serves the tokens of a run without the connector and still hits what it stored; the
tier's directories are 0700 (issue 14)."""

import os
import random
import socket
import stat
import time

import pytest

from vllm_kvbm_plugin.testing.files import locked_writer
from vllm_kvbm_plugin.tiers import block_dir, block_file

from .helpers import outputs

pytestmark = pytest.mark.engine
rng = random.Random(23)
PROMPT = [rng.randrange(10, 2000) for _ in range(200)]  # 6 full blocks of 32 go to the tiers
HIT = 192


def spec(**extra):
    llm = {"max_model_len": 1024}
    if extra:
        llm["kv_transfer_config"] = {
            "kv_connector": "KVBMConnector", "kv_connector_module_path": "vllm_kvbm_plugin.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return {"model": "llama", "llm": llm, "events": False, "steps": [{"prompts": [PROMPT]}]}


def foreign_name(prefix: str) -> str:
    return prefix + "".join(rng.choice("0123456789abcdef") for _ in range(30)) + block_dir.SUFFIX


def populate(rank: str, outside: str, work: str) -> dict:
    """Every kind of foreign content in the rank directory (next to the real blocks, in their
    prefix directories and in new ones); returns what must still be there afterwards."""
    real_prefixes = sorted(n for n in os.listdir(rank))
    p0 = os.path.join(rank, real_prefixes[0])
    used = {n[:2] for n in real_prefixes}
    new = sorted({f"{i:02x}" for i in range(256)} - used)[:4]  # prefixes no block of the prompt uses
    fresh = os.path.join(rank, new[0])
    os.mkdir(fresh, 0o700)
    passwd = os.path.join(work, "passwd")
    with open(passwd, "w") as f:
        f.write("root:x:0:0:root:/root:/bin/bash\n")
    keep = {}

    def at(kind, d=p0):
        keep[kind] = os.path.join(d, foreign_name(os.path.basename(d)))
        return keep[kind]

    os.mkfifo(at("fifo"))
    os.mkfifo(at("fifo_new_prefix", fresh))
    os.symlink(outside, at("symlink_to_block"))
    os.symlink(passwd, at("symlink_to_passwd"))
    os.symlink(os.path.join(work, "nowhere"), at("dangling_symlink"))
    os.mkdir(at("directory"))
    os.mkdir(at("directory_new_prefix", fresh))
    cwd = os.getcwd()
    os.chdir(p0)  # a socket's path must be short
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(os.path.basename(at("socket")))
    finally:
        os.chdir(cwd)
    try:
        os.mknod(at("char_device"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except OSError:
        keep.pop("char_device")
    for kind, name in (("readme", "README"), ("upper", foreign_name(p0[-2:]).upper()),
                       ("foreign_tmp", "notes.tmp")):
        keep[kind] = os.path.join(p0, name)
        with open(keep[kind], "w") as f:
            f.write("not ours")
    keep["wrong_prefix"] = os.path.join(fresh, foreign_name(new[1]))  # would be found elsewhere
    with open(keep["wrong_prefix"], "wb") as f:
        f.write(open(outside, "rb").read())
    os.symlink(os.path.dirname(outside), os.path.join(rank, new[2]))  # a prefix directory as a symlink
    keep["prefix_symlink"] = os.path.join(rank, new[2])
    os.mkfifo(os.path.join(rank, new[3]))  # ... as a FIFO
    keep["prefix_fifo"] = os.path.join(rank, new[3])
    keep["layout_file"] = os.path.join(os.path.dirname(rank), "notes.txt")
    with open(keep["layout_file"], "w") as f:
        f.write("not ours")
    # regular files named like block files that cannot be read: misses (the scheduler may drop them)
    drop = {"sparse_4g": at("sparse_4g"), "version_1": at("version_1")}
    with open(drop["sparse_4g"], "wb") as f:
        f.truncate(4 << 30)
    data = bytearray(open(outside, "rb").read())
    data[4:6] = (1).to_bytes(2, "little")
    with open(drop["version_1"], "wb") as f:
        f.write(bytes(data))
    for k in drop:
        keep.pop(k)
    return {"keep": keep, "drop": drop, "socket": sock, "passwd": passwd}


@pytest.fixture(scope="module")
def foreign_run(run_engine, tmp_path_factory):
    work = tmp_path_factory.mktemp("foreign")
    kv = work / "kv"
    plain = run_engine(spec())
    t0 = time.monotonic()
    first = run_engine(spec(cpu_bytes_to_use=4 << 20, disk_path=str(kv)))
    first_time = time.monotonic() - t0
    files = sorted(kv.rglob("*.kvb"))
    assert len(files) == 6, files
    rank = str(files[0].parent.parent)
    layout = os.path.dirname(rank)
    first_modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in (str(kv), layout, rank, str(files[0].parent))}
    outside = str(work / "elsewhere.kvb")
    with open(outside, "wb") as f:
        f.write(files[0].read_bytes())
    content = populate(rank, outside, str(work))
    # a temporary file another engine is writing right now, and one a crash left
    live = os.path.join(str(files[1].parent), foreign_name(files[1].parent.name) + ".tmp999999.cafe")
    abandoned = str(files[2]) + ".tmp4242"
    with open(abandoned, "wb") as f:
        f.write(b"partial")
    writer = locked_writer(live, 900)
    # directories an older version left open to other users
    for p in (layout, rank, str(files[0].parent)):
        os.chmod(p, 0o755)
    try:
        t0 = time.monotonic()
        second = run_engine(spec(cpu_bytes_to_use=4 << 20, disk_path=str(kv)), timeout=300)
        second_time = time.monotonic() - t0
        live_kept = os.path.exists(live)
    finally:
        writer.kill()
        writer.wait()
        content["socket"].close()
    return {"plain": plain, "first": first, "second": second, "first_time": first_time,
            "second_time": second_time, "files": files, "content": content, "live_kept": live_kept,
            "abandoned": abandoned, "kv": str(kv), "layout": layout, "rank": rank,
            "first_modes": first_modes, "outside": outside}


def test_foreign_content_never_hangs_crashes_or_fools_the_engine(foreign_run):
    r = foreign_run
    assert r["second_time"] < r["first_time"] + 60, (r["first_time"], r["second_time"])
    (o,) = outputs(r["second"])
    assert o["tokens"] == outputs(r["plain"])[0]["tokens"]
    assert o["num_cached_tokens"] == HIT, "the untouched entries are still hits"
    assert all(f.is_file() for f in r["files"])
    c = r["content"]
    for kind, p in c["keep"].items():
        assert os.path.lexists(p), f"{kind} was removed"
    assert open(c["passwd"]).read().startswith("root:") and block_file.read_meta(r["outside"]) is not None
    assert r["live_kept"], "a live writer's temporary file stays"
    assert not os.path.exists(r["abandoned"]), "a crash's leftover is removed"


def test_the_tier_directories_are_private(foreign_run):
    r = foreign_run
    assert set(r["first_modes"].values()) == {0o700}, r["first_modes"]  # created by the first engine
    for f in r["files"]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600


def test_existing_tier_directories_are_tightened_at_startup(foreign_run):
    r = foreign_run
    for p in (r["layout"], r["rank"], str(r["files"][0].parent)):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p
    assert "now 700" in r["second"]["log"] or "now 0700" in r["second"]["log"]
