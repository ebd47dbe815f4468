# SPDX-License-Identifier: Apache-2.0
"""The remote tier's connection to Redis or Valkey: one redis-py client behind a circuit breaker.

:class:`RedisConnection` makes the client lazily for a standalone server, a Sentinel or a Cluster.
Every operation runs through :meth:`RedisConnection.run`, which the breaker may refuse at once.
A network failure drops the idle connections, since they are stale once the server restarts.
:func:`send_packed` writes one command from several buffers without joining them.
The timeouts and the breaker are described in :mod:`lmcache.tiers.redis.tier`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lmcache.tiers.redis.url import RemoteTarget
from lmcache.tiers.tier_guard import Breaker

if TYPE_CHECKING:
    import redis

__all__ = ["RedisConnection", "is_cluster", "require_redis", "send_packed", "unlink_names"]

logger = logging.getLogger("lmcache.tiers.redis.tier")  # one logger name for the whole tier

_T = TypeVar("_T")
#: redis-py < 5.3 needs a command name for ``ConnectionPool.get_connection`` (later ones warn).
_OLD_REDIS_PY: bool | None = None


def require_redis() -> None:
    """Import redis-py once, or raise an ``ImportError`` that says how to install it."""
    try:
        import redis
    except ImportError as exc:
        raise ImportError(
            "lmcache's remote tier (remote_url) needs redis-py: pip install 'redis>=5.0' "
            "hiredis (lmcache-core's [redis] extra)"
        ) from exc
    global _OLD_REDIS_PY
    if _OLD_REDIS_PY is None:
        from packaging.version import Version

        _OLD_REDIS_PY = Version(redis.__version__) < Version("5.3")


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a Redis Cluster client (its connections are per node)."""
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster)


class RedisConnection:
    """One lazily made redis-py client for ``target``, used through a circuit breaker.

    Thread-safe: callers share redis-py's connection pool.

    Args:
        target: The parsed ``remote_url``.
        password: Used when the URL carries none (``LMCACHE_REMOTE_PASSWORD``).
        timeout: Seconds to connect and for each socket read or write.
        breaker: Counts failed operations and refuses them while open.
    """

    def __init__(
        self, target: RemoteTarget, password: str | None, timeout: float, breaker: Breaker
    ) -> None:
        self._target = target
        self._password = password
        self._timeout = timeout
        self._breaker = breaker
        self._lock = threading.Lock()
        self._client_obj: Any = None  # redis.Redis or redis.cluster.RedisCluster, made lazily

    def _connection_kwargs(self) -> dict[str, Any]:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return {
            "socket_timeout": self._timeout,
            "socket_connect_timeout": self._timeout,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
            "socket_read_size": 1 << 20,
            "protocol": 2,
        }

    def _make_client(self) -> Any:
        import redis
        from redis.cluster import RedisCluster
        from redis.sentinel import Sentinel

        target = self._target
        kwargs = self._connection_kwargs()
        if target.mode == "sentinel":
            sentinel_kwargs = dict(kwargs, ssl=target.ssl)
            sentinel_cls: Any = Sentinel  # redis-py leaves Sentinel untyped
            sentinel = sentinel_cls(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
            return sentinel.master_for(
                target.service,
                db=target.db,
                username=target.username,
                password=target.password or self._password,
                ssl=target.ssl,
                **kwargs,
            )
        if self._password is not None:
            kwargs["password"] = self._password  # the URL's password, if any, wins
        if target.mode == "cluster":
            kwargs.pop("health_check_interval")
            return RedisCluster.from_url(target.url, **kwargs)
        pool = redis.ConnectionPool.from_url(target.url, **kwargs)
        return redis.Redis(connection_pool=pool)

    def client(self) -> Any:
        """The client, made on first use."""
        with self._lock:
            if self._client_obj is None:
                self._client_obj = self._make_client()
            return self._client_obj

    def drop_connections(self, client: Any) -> None:
        """After a network failure: forget idle connections (stale once the server restarts)."""
        try:
            if is_cluster(client):
                with self._lock:
                    if self._client_obj is client:
                        self._client_obj = None
                client.close()  # rediscover the topology next time
            else:
                client.connection_pool.disconnect(inuse_connections=False)
        except Exception:  # pragma: no cover - best effort
            logger.debug("lmcache remote tier: dropping connections failed", exc_info=True)

    def run(self, op: Callable[[Any], _T]) -> _T:
        """Run ``op(client)`` through the circuit breaker.

        Raises:
            TierUnavailable: the breaker is open.
            Exception: whatever ``op`` raised (network failures are counted by the breaker).
        """
        from redis.exceptions import ClusterDownError, RedisClusterException, RedisError
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        trial = self._breaker.admit()
        client: Any = None
        try:
            client = self.client()
            result = op(client)
        except (
            RedisConnectionError,
            RedisTimeoutError,
            RedisClusterException,
            ClusterDownError,
            OSError,
        ) as exc:
            self._breaker.record(False, trial, exc)
            if client is not None:
                self.drop_connections(client)
            raise
        except RedisError:
            self._breaker.record(True, trial)  # the server answered (e.g. OOM): it is reachable
            raise
        except BaseException:
            self._breaker.record(None, trial)
            raise
        self._breaker.record(True, trial)
        return result

    def close(self) -> None:
        """Close the client's connections; the next operation makes a new client."""
        with self._lock:
            client, self._client_obj = self._client_obj, None
        if client is None:
            return
        if is_cluster(client):
            client.close()
        else:
            client.connection_pool.disconnect()


def unlink_names(node: redis.Redis, names: list[bytes]) -> None:
    """``UNLINK`` each name, one pipelined round trip (one key per command: cluster-safe)."""
    pipe = node.pipeline(transaction=False)
    for name in names:
        pipe.unlink(name)
    pipe.execute()


def send_packed(pool: Any, parts: Sequence[bytes | memoryview]) -> None:
    """Send one packed command from ``parts`` as they are (no concatenation) and check the reply.

    Raises:
        redis.exceptions.RedisError: an error reply, a timeout or a lost connection (the
            connection is then dropped, not returned to the pool in an unknown state).
    """
    conn = pool.get_connection("SET") if _OLD_REDIS_PY else pool.get_connection()
    try:
        conn.send_packed_command(parts, check_health=False)
        conn.read_response()
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
