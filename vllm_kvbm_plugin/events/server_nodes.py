"""The server as `vllm-kvbm announce` (events/announcer.py) uses it: a client per node (the one
server, or every master of a Redis Cluster, whose keyspace notifications are its own), the node
owning a key, and whether the cluster's masters or slots changed since it connected."""

from __future__ import annotations

from typing import Any

from vllm_kvbm_plugin.log import redact_url
from vllm_kvbm_plugin.tiers import resp


class TopologyChanged(Exception):
    """The cluster's masters or their slots changed: subscribe again (on the new masters) and rescan."""


class ServerNodes:
    """The server as the announcer uses it: a client per node (the one server, or every master of
    a cluster, whose notifications are its own), and the node owning a key."""

    def __init__(self, url: str) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.crc import key_slot
        from redis.retry import Retry

        # no silent retries: a reconnect must go through a rescan (notifications in between are lost)
        self.opts: dict[str, Any] = dict(socket_timeout=10, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0),
                         health_check_interval=0)
        self.where, self.owner, self.topology, self.key_slot = redact_url(url), None, None, key_slot
        if not url.startswith(resp.CLUSTER_SCHEMES):  # the URL's password, if any, wins
            self.clients = [redis.Redis.from_url(url, password=resp.auth_password(None), **self.opts)]
            self.db = self.clients[0].connection_pool.connection_kwargs.get("db", 0)
            return
        seeds, user, password = resp.cluster_seeds(url)
        self.opts.update(username=user, password=password, ssl=url.startswith("rediss"))
        self.db, self.clients = 0, []
        error: Exception | None = None
        for host, port in seeds:  # the first seed that answers tells the slots
            seed = redis.Redis(host=host, port=port, **self.opts)
            try:
                self.topology = self._slots(seed)
                break
            except redis.RedisError as e:
                error = e
            finally:
                seed.close()
        else:
            raise error or ConnectionError(f"{self.where}: no seed node")
        masters = sorted({(h, p) for _, _, h, p in self.topology})
        self.clients = [redis.Redis(host=h, port=p, **self.opts) for h, p in masters]
        self.owner = bytearray(16384)  # slot -> index of its master in clients
        for start, end, h, p in self.topology:
            self.owner[start:end + 1] = bytes([masters.index((h, p))]) * (end - start + 1)

    @staticmethod
    def _slots(client: Any) -> tuple[tuple[int, int, str, int], ...]:
        """(start, end, master host, master port) of every slot range, sorted."""
        ranges = client.execute_command("CLUSTER", "SLOTS", NEVER_DECODE=True)
        out = []
        for r in ranges:
            host = r[2][0].decode() if isinstance(r[2][0], bytes) else r[2][0]
            out.append((int(r[0]), int(r[1]), host or "127.0.0.1", int(r[2][1])))
        return tuple(sorted(out))

    def of(self, name: str | bytes) -> int:
        """Index of the client holding key `name`."""
        if self.owner is None:
            return 0
        return self.owner[self.key_slot(name if isinstance(name, bytes) else name.encode())]

    def markers(self, base: str) -> list[str]:
        """One marker name per node, each on that node's slots (a hash tag picks the slot)."""
        if self.owner is None:
            return [base]
        out = []
        for i in range(len(self.clients)):
            tag = 0
            while self.of(f"{base}:{{{tag}}}") != i:
                tag += 1
            out.append(f"{base}:{{{tag}}}")
        return out

    def check(self) -> None:
        """Raise TopologyChanged when the cluster's slots moved since we connected."""
        if self.owner is not None and self._slots(self.clients[0]) != self.topology:
            raise TopologyChanged(f"{self.where}: the cluster's masters or slots changed")

    def run(self, commands: list) -> list:
        """(method, key, *args) commands, one pipeline per node they go to; results in order."""
        per: dict = {}
        for i, (method, key, *args) in enumerate(commands):
            per.setdefault(self.of(key), []).append((i, method, key, args))
        out: list = [None] * len(commands)
        for node, cmds in per.items():
            pipe = self.clients[node].pipeline(transaction=False)
            for _, method, key, args in cmds:
                getattr(pipe, method)(key, *args)
            for (i, *_), value in zip(cmds, pipe.execute()):
                out[i] = value
        return out

    def close(self) -> None:
        for c in self.clients:
            c.close()
