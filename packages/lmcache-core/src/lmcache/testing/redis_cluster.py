# SPDX-License-Identifier: Apache-2.0
"""A Redis Cluster of real servers, and a Sentinel watching one, for tests.

:class:`RedisClusterServer` starts three masters with ``cluster-enabled yes`` and joins them
with ``redis-cli --cluster create``. :class:`RedisSentinel` runs ``redis-server --sentinel``
watching a :class:`~lmcache.testing.redis_process.RedisServer`.
:mod:`lmcache.testing.redis_server` is the public import path.
"""

from __future__ import annotations

import os
import subprocess
from urllib.parse import quote

from lmcache.testing.redis_process import (
    RedisServer,
    StartedOnEnter,
    conf_quoted,
    redis_cli_path,
    wait_for,
)
from lmcache.testing.resp import HOST

__all__ = ["RedisClusterServer", "RedisSentinel"]


class RedisClusterServer(StartedOnEnter):
    """A Redis Cluster of ``masters`` masters (no replicas) on ``127.0.0.1`` (context manager).

    Args:
        masters: How many masters (Redis needs at least 3).
        password: ``requirepass`` and ``masterauth`` of every node.

    Raises:
        RuntimeError: (from :meth:`start`) the binary has no cluster mode, ``redis-cli`` is
            missing, or the cluster did not reach ``cluster_state:ok``; the message says which.
    """

    def __init__(self, masters: int = 3, *, password: str | None = None) -> None:
        args: tuple[str, ...] = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        args += ("--cluster-node-timeout", "2000")
        self.password = password
        self.nodes = [RedisServer(password=password, args=args) for _ in range(masters)]
        if password is not None:
            for node in self.nodes:
                node.append_config(f"masterauth {conf_quoted(password)}")

    @property
    def url(self) -> str:
        """``redis+cluster://[:password@]127.0.0.1:port`` of the first node."""
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"redis+cluster://{auth}{HOST}:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start the nodes, create the cluster, and wait for ``cluster_state:ok`` everywhere."""
        cli = redis_cli_path()
        if cli is None:
            raise RuntimeError("RedisClusterServer: redis-cli/valkey-cli not found")
        for node in self.nodes:
            node.start()
        info = node.command("INFO", "cluster")
        if not isinstance(info, bytes) or b"cluster_enabled:1" not in info:
            raise RuntimeError(f"{node.binary} does not run in cluster mode here: {info!r}")
        command = [cli, "--cluster", "create", *(f"{HOST}:{n.port}" for n in self.nodes)]
        command += ["--cluster-replicas", "0", "--cluster-yes"]
        env = dict(os.environ)
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password  # not on the command line
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        wait_for(
            lambda: [n.command("CLUSTER", "INFO") for n in self.nodes],
            lambda states: all(isinstance(s, bytes) and b"cluster_state:ok" in s for s in states),
            timeout,
            "cluster did not reach cluster_state:ok",
        )

    def stop(self) -> None:
        """Stop every node (their folders stay until :meth:`cleanup`)."""
        for node in self.nodes:
            node.stop()

    def cleanup(self) -> None:
        """Stop every node and remove the folders."""
        for node in self.nodes:
            node.cleanup()


class RedisSentinel(StartedOnEnter):
    """A Sentinel (``redis-server --sentinel``) watching ``master`` (context manager).

    Args:
        master: The running server to watch.
        service: The master's name in Sentinel.
    """

    def __init__(self, master: RedisServer, service: str = "mymaster") -> None:
        self.master = master
        self.service = service
        lines = [f"sentinel monitor {service} {HOST} {master.port} 1"]
        if master.password is not None:
            lines.append(f"sentinel auth-pass {service} {conf_quoted(master.password)}")
        self.server = RedisServer(args=("--sentinel",))
        self.server.append_config(*lines)

    @property
    def url(self) -> str:
        """``redis+sentinel://[:password@]127.0.0.1:port/service`` (the master's password)."""
        password = self.master.password
        auth = f":{quote(password, safe='')}@" if password is not None else ""
        return f"redis+sentinel://{auth}{HOST}:{self.server.port}/{self.service}"

    def start(self, timeout: float = 10.0) -> None:
        """Start the sentinel and wait until it names the master."""
        self.server.start(timeout)
        wait_for(
            lambda: self.server.command("SENTINEL", "get-master-addr-by-name", self.service),
            lambda found: found == [HOST.encode(), str(self.master.port).encode()],
            timeout,
            "sentinel does not know the master",
        )

    def cleanup(self) -> None:
        """Stop the sentinel and remove its folder."""
        self.server.cleanup()
