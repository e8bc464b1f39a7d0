from vllm_kvbm_plugin.events.holders import Holders


def test_announce_on_first_hold_and_remove_on_last_release():
    h = Holders()
    assert h.hold("a") is True
    assert h.hold("a") is False  # second physical block with the same hash: no new announcement
    assert h.release("a") is False  # one holder left
    assert "a" in h
    assert h.release("a") is True
    assert "a" not in h and len(h) == 0
