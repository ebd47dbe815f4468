# SPDX-License-Identifier: Apache-2.0
"""Real Redis/Valkey servers for tests: one server, a 3-master cluster, or a Sentinel.

Each server is a ``redis-server`` (or ``valkey-server``) process on ``127.0.0.1``, on a free
port, with its own temporary folder and no persistence (``save ''``, ``appendonly no``)::

    from lmcache.testing.redis_server import RedisServer, redis_server_path

    if redis_server_path() is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    with RedisServer(password="s3cret") as server:
        tier = RedisTier(server.url)
        server.pause()   # SIGSTOP: connections hang until resume()
        server.resume()
        server.stop()    # SHUTDOWN; start() brings it back on the same port (empty)
        server.start()

:class:`RedisClusterServer` starts three masters with ``cluster-enabled yes`` and joins them with
``redis-cli --cluster create``; :class:`RedisSentinel` watches a :class:`RedisServer`. The
helpers speak RESP over a plain socket, so they need no redis-py. Processes are killed when their
object is garbage-collected or the interpreter exits, even without ``stop()``.

``LMCACHE_REDIS_SERVER`` may name the server binary (``redis-cli``/``valkey-cli`` is looked up
beside it, then on ``PATH``).

This module is the import path; the code lives in three modules.
:mod:`lmcache.testing.redis_process` runs one server and finds the binaries.
:mod:`lmcache.testing.redis_cluster` builds a cluster or a sentinel from such servers.
:mod:`lmcache.testing.resp` is the socket client.
"""

from __future__ import annotations

from lmcache.testing.redis_cluster import RedisClusterServer, RedisSentinel
from lmcache.testing.redis_process import RedisServer, redis_cli_path, redis_server_path
from lmcache.testing.resp import resp_command

__all__ = [
    "RedisClusterServer",
    "RedisSentinel",
    "RedisServer",
    "redis_cli_path",
    "redis_server_path",
    "resp_command",
]
