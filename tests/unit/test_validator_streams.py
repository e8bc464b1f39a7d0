"""Merged streams of a fleet: each instance's local tiers are its own indexes, the REMOTE tier is one
index for every publisher (a remote entry announced twice is a duplicate), and the announcer's
AllBlocksCleared clears the remote tier (a flush), never anyone's GPU blocks."""

import json

import pytest

from vllm_kvbm_plugin import cli
from vllm_kvbm_plugin.config import KVBMConfig
from vllm_kvbm_plugin.events import recording
from vllm_kvbm_plugin.events.types import LOCALITY_REMOTE, MEDIUM_STORAGE, AllBlocksCleared, KVEventBatch

from .test_validator import removed, stored

REMOTE = {"medium": MEDIUM_STORAGE, "locality": LOCALITY_REMOTE, "ownership": "kvbm-remote:ab"}


def batch(ts, *events):
    return KVEventBatch(ts=ts, events=list(events), data_parallel_rank=0)


def validate(tmp_path, capsys, *streams) -> dict:
    files = []
    for i, records in enumerate(streams):
        f = tmp_path / f"stream{i}.jsonl"
        with open(f, "w") as fp:
            recording.write(fp, list(enumerate(records)))
        files.append(str(f))
    code = cli.main(["validate", *files])
    report = json.loads(capsys.readouterr().out)
    assert code == (1 if report["errors"] else 0)
    return report


def test_two_instances_and_the_announcer_merge(tmp_path, capsys):
    a = [batch(1.0, stored([1, 2])), batch(4.0, removed([2]))]
    b = [batch(2.0, stored([1, 2])), batch(5.0, AllBlocksCleared())]  # same GPU hashes: its own index
    ann = [batch(3.0, stored([1], **REMOTE)), batch(3.5, stored([2], parent=1, **REMOTE)),
           batch(6.0, removed([2], **REMOTE))]
    report = validate(tmp_path, capsys, a, b, ann)
    assert report["errors"] == 0, report["first_problems"]
    assert report["tiers"]["GPU"] == {"stored": 4, "removed": 1, "held": 1}  # A's 1; B cleared its own
    assert report["tiers"]["STORAGE:REMOTE:kvbm-remote:ab"] == {"stored": 2, "removed": 1, "held": 1}


def test_a_remote_entry_announced_by_two_instances_is_a_duplicate(tmp_path, capsys):
    a = [batch(1.0, stored([1]), stored([1], **REMOTE))]
    b = [batch(2.0, stored([1]), stored([1], **REMOTE))]
    report = validate(tmp_path, capsys, a, b)
    assert report["by_rule"]["duplicate_store"] == 1
    assert report["first_problems"][0]["tier"] == "STORAGE:REMOTE:kvbm-remote:ab"


def test_the_announcers_all_blocks_cleared_is_a_flush_of_the_remote_tier(tmp_path, capsys):
    a = [batch(1.0, stored([1, 2])), batch(5.0, removed([1, 2]))]
    ann = [batch(2.0, stored([1], **REMOTE)), batch(3.0, AllBlocksCleared()), batch(4.0, stored([1], **REMOTE))]
    report = validate(tmp_path, capsys, a, ann)
    assert report["errors"] == 0, report["first_problems"]
    assert report["tiers"]["GPU"]["held"] == 0  # A's GPU blocks were not cleared by the announcer
    assert report["tiers"]["STORAGE:REMOTE:kvbm-remote:ab"] == {"stored": 2, "removed": 0, "held": 1}


def test_remote_events_config_key():
    assert KVBMConfig.from_extra({}).remote_events == "announcer"
    assert KVBMConfig.from_extra({"remote_events": "instance"}).remote_events == "instance"
    with pytest.raises(ValueError, match="remote_events must be one of announcer, instance"):
        KVBMConfig.from_extra({"remote_events": "both"})
