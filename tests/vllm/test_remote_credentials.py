"""Credentials of the remote tier, tried as a new user would on a real redis-server that needs a user
and a password (ACL): a password inside remote_url is shown in no log line or error of ours (two
scheduler sides with their workers, the server going down and back, bad URLs); a password given in
KVBM_REMOTE_PASSWORD instead authenticates every connection we open."""

import logging
import os
import time

import numpy as np
import pytest

from vllm_kvbm_plugin.log import redact_url
from vllm_kvbm_plugin.testing.redis_server import RedisServer, server_binary
from vllm_kvbm_plugin.tiers import remote_value, resp
from vllm_kvbm_plugin.tiers import secret as tiersecret
from vllm_kvbm_plugin.tiers.breaker import Breaker

from .test_remote_tier import instance, prompt

pytest.importorskip("redis", reason="redis-py is not installed (scripts/setup.sh installs it)")
pytestmark = pytest.mark.skipif(server_binary() is None,
                                reason="no redis-server on PATH: scripts/setup.sh installs Debian's as root")

PASSWORD = "pw-" + os.urandom(12).hex()


def acl_server() -> RedisServer:
    """User `kvbm` with PASSWORD may do anything; the default user only PING (RedisServer's check)."""
    return RedisServer(extra_args=("--user", "kvbm", "on", f">{PASSWORD}", "~*", "&*", "+@all",
                                   "--user", "default", "on", "nopass", "-@all", "+ping"))


class Lines(logging.Handler):
    """Every record of our loggers (vllm.kvbm.*), formatted with its traceback."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.text = []
        self.setFormatter(logging.Formatter("%(name)s %(message)s"))

    def emit(self, record):
        self.text.append(self.format(record))


@pytest.fixture
def lines():
    h, logger = Lines(), logging.getLogger("vllm.kvbm")
    level = logger.level
    logger.addHandler(h)
    logger.setLevel(logging.DEBUG)
    yield h.text
    logger.removeHandler(h)
    logger.setLevel(level)


def test_redact_url():
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url(f"redis://kvbm:{PASSWORD}@h:1/0") == "redis://kvbm:***@h:1/0"
    assert redact_url(f"rediss://:{PASSWORD}@h") == "rediss://:***@h"
    assert redact_url(f"redis://{PASSWORD}@h/0") == "redis://***@h/0"  # a user part alone may be a password
    assert redact_url(f"redis://u:p@{PASSWORD}@h/0") == "redis://u:***@h/0"  # an unescaped @ in it
    assert redact_url(f"redis+cluster://u:{PASSWORD}@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redact_url(f"unix:///s.sock?db=1&password={PASSWORD}&x=1") == "unix:///s.sock?db=1&password=***&x=1"


def test_a_password_in_remote_url_is_in_no_log_line_or_error_of_ours(lines):
    server = acl_server().start()
    try:
        url = f"redis://kvbm:{PASSWORD}@127.0.0.1:{server.port}/0"
        a, b = instance(url, remote_events="instance"), instance(url, remote_events="instance")
        p = prompt()
        assert a.serve(p) == 0
        assert b.serve(p) == 192  # the password in the URL works
        server.kill()  # down: every side's breaker opens and logs the server
        for h in (a, b):
            h.serve(prompt())
        server.start()  # back (empty): after their backoff the breakers close and log it
        time.sleep(Breaker.MIN_BACKOFF * 2)
        for h in (a, b):
            h.serve(prompt())
        errors = []
        for bad in (f"http://kvbm:{PASSWORD}@h:1", f"redis+cluster://kvbm:{PASSWORD}@h:x"):
            with pytest.raises(ValueError) as e:
                resp.check_url(bad)
            errors.append(str(e.value))
        tiersecret.load(f"redis://kvbm:{PASSWORD}@127.0.0.1:1/0", None, env={})  # refused: logged
    finally:
        server.stop()
    text = "\n".join(lines + errors)
    assert "server back" in text and "every remote lookup, read and write is a miss" in text
    assert "kvbm:***@127.0.0.1" in text and "cannot read the block-key secret" in text
    assert PASSWORD not in text


def test_the_password_from_the_environment_authenticates_every_connection(monkeypatch):
    server = acl_server().start()
    try:
        url = f"redis://kvbm@127.0.0.1:{server.port}/0"  # the user in the URL, the password elsewhere
        import redis

        with pytest.raises(redis.RedisError):  # without it: refused
            resp.connect_ready(url)
        monkeypatch.setenv(resp.PASSWORD_ENV, PASSWORD)
        key, fp, mk = (1, 2), bytes(16), tiersecret.load(url, None, env={}).key
        from vllm_kvbm_plugin.tiers.mac import mac_key

        payload = np.arange(4096, dtype=np.uint8)
        for client in (resp.connect_ready(url), resp.connect_direct(url)):
            resp.store_values(client, ["kvbm:x"], [remote_value.value_parts(key, fp, mac_key(mk), payload, b"")])
        out = [np.zeros(4096, dtype=np.uint8)]
        reader = resp.DirectClient(url)
        assert reader.fetch(["kvbm:x"], [key], fp, mac_key(mk), out) == [remote_value.OK]
        assert np.array_equal(out[0], payload)
        # the URL's own password wins over the environment's
        monkeypatch.setenv(resp.PASSWORD_ENV, "wrong")
        assert resp.connect_ready(f"redis://kvbm:{PASSWORD}@127.0.0.1:{server.port}/0").ping()
        with pytest.raises(redis.RedisError):
            resp.connect_ready(url)
    finally:
        server.stop()
