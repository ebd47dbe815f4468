# SPDX-License-Identifier: Apache-2.0
"""The remote tier: chunks in a shared Redis or Valkey server, through redis-py.

URL forms (``remote_url``)::

    redis://[user:password@]host[:port][/db]        plain TCP (port 6379, db 0 by default)
    rediss://[user:password@]host[:port][/db]       TLS (query: ssl_ca_certs, ssl_cert_reqs, ...)
    valkey://...  valkeys://...                     the same as redis:// and rediss://
    unix://[user:password@]/path/to/socket[?db=N]   a local socket
    redis+cluster://[user:password@]host[:port]     Redis Cluster: any node; the rest is discovered
                                                    (also rediss+, valkey+, valkeys+cluster://)
    redis+sentinel://[user:password@]host[:port][,host2[:port2]...]/service_name[/db]
                                                    Sentinel (port 26379 by default); the
                                                    password is the master's (also rediss+,
                                                    valkey+, valkeys+sentinel://)

The password may instead come from the environment variable ``LMCACHE_REMOTE_PASSWORD`` (used
when the URL carries none), which keeps it out of config files. It is never logged, put in an
error message or in ``repr``: URLs are shown with the password as ``***``.

Key names are ``{namespace}:{fingerprint_hex}:{key_hex}`` (``lmcache:0f3a…:9b21…``): the
fingerprint digest (model, geometry, dtype, rank, cache salt) keeps models and tenants apart on
one server, and the namespace keeps deployments apart. Values are
:mod:`lmcache.tiers.chunk_format` entries (header + raw bytes); every value read is verified
(header checksum, key, fingerprint, geometry, length, payload checksum) before a connector sees
it, and a value that fails is deleted. :meth:`RedisTier._clear` deletes with ``SCAN MATCH`` +
``UNLINK`` in batches (on a cluster, on every primary).

Every operation is bounded in time: connect and socket timeouts are ``timeout`` seconds and
redis-py's own retries are off, so a dead or paused (SIGSTOP) server costs one ``timeout`` per
operation at most. A circuit breaker bounds the total: after ``breaker_failures`` consecutive
failed operations the tier is *open* for ``breaker_cooldown`` seconds, during which operations
are misses at once without touching the network; then one trial operation decides whether it
closes again. The breaker logs only when it opens and when it closes. A server that is
unreachable when the tier is made is not an error: the tier starts open (one log line) and
reconnects by itself once the server answers, without restarting the engine.

Batches use one round trip: ``contains`` pipelines ``EXISTS``, ``read_into`` pipelines ``GET``
(cut into groups of at most :attr:`RedisTier.read_group_bytes` bytes so a read of many 32 MiB
chunks does not hold them all in memory twice). A write is one ``SET`` (``PX`` with a TTL) whose
value is sent from the header and the host buffer as they are, without concatenating them
(except on a cluster after a slot moved, where redis-py's redirect handling takes over).

The tier is thread-safe: the writer thread and readers share redis-py's connection pool.

Eviction: lmcache chooses nothing here. The server evicts by its own ``maxmemory-policy`` (and
entries expire with ``ttl``); lmcache neither sees nor orders those evictions, so the
prefix-keeping order of the CPU and disk tiers (orphans first, a prompt's tail before its head)
does not apply. What lmcache does control is the write order: a run of one chain is written
tail first, so its head is the most recently written key and an LRU or LFU policy tends to drop
a prompt's tail before its head. Values carry no parent (chunk format version 1, which readers
of every lmcache version read), since nothing here would use it.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from lmcache.errors import ConfigError, CorruptChunk
from lmcache.tiers.chunk_format import HEADER_BYTES, ChunkHeader, verify_chunk
from lmcache.tiers.lower_tier import LowerTier, ReadRequest
from lmcache.tiers.redis.client import (
    RedisConnection,
    is_cluster,
    require_redis,
    send_packed,
    unlink_names,
)
from lmcache.tiers.redis.url import mask_url, parse_remote_url
from lmcache.tiers.tier_guard import Breaker, progress

__all__ = ["PASSWORD_ENV", "RedisTier", "mask_url"]

logger = logging.getLogger(__name__)

#: Environment variable holding the server password when the URL has none.
PASSWORD_ENV = "LMCACHE_REMOTE_PASSWORD"

_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-/]+")
_SCAN_COUNT = 1000


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"RedisTier needs contiguous CPU read buffers, found device={tensor.device}, "
            f"contiguous={tensor.is_contiguous()}; pass a host chunk lease's tensor."
        )
    return tensor.reshape(-1).view(torch.uint8).numpy().data


class RedisTier(LowerTier):
    """Chunks in a Redis/Valkey server (standalone, Sentinel or Cluster). See the module doc.

    Args:
        url: Where the server is (forms in the module docstring).
        namespace: Prefix of every key name (letters, digits, ``_.-/``); deployments that share
            a server but must not share chunks use different namespaces.
        timeout: Seconds allowed to connect and for each socket read or write of an operation.
        ttl: Seconds after which a stored chunk expires (``SET ... PX``), or ``None`` for never.
        write_queue_bytes: Bytes of queued writes beyond which new writes are dropped.
        breaker_failures: Consecutive failed operations that open the circuit breaker.
        breaker_cooldown: Seconds the breaker stays open before one trial operation.
        tier_timeout: Seconds a read (``contains``, ``read_into``) may go without progress
            before it is abandoned (:class:`~lmcache.tiers.LowerTier`); ``None``: no deadline
            beyond ``timeout`` per socket operation.

    Raises:
        ConfigError: a malformed URL, unknown scheme, or bad namespace/timeout/ttl/breaker value
            (never showing the password).
        ImportError: redis-py is not installed.
    """

    kind = "remote"

    #: Bytes of values one pipelined ``GET`` round trip may return (at least one value).
    read_group_bytes: int = 64 << 20

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "lmcache",
        timeout: float = 1.0,
        ttl: float | None = None,
        write_queue_bytes: int = 1 << 30,
        breaker_failures: int = 3,
        breaker_cooldown: float = 5.0,
        tier_timeout: float | None = 5.0,
    ) -> None:
        target = parse_remote_url(url)
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise ConfigError(
                f"RedisTier namespace: expected letters, digits and '_.-/' (e.g. 'lmcache'), "
                f"found {namespace!r}. Choose a plain name; it prefixes every key."
            )
        for name, value, ok in (
            ("timeout", timeout, math.isfinite(timeout) and timeout > 0),
            ("ttl", ttl, ttl is None or (math.isfinite(ttl) and ttl >= 0.001)),
            ("breaker_failures", breaker_failures, breaker_failures >= 1),
            ("breaker_cooldown", breaker_cooldown, breaker_cooldown >= 0),
        ):
            if not ok:
                raise ConfigError(
                    f"RedisTier {name}: expected a positive finite number (ttl: None or >= "
                    f"0.001 s, breaker_failures >= 1), found {value!r}."
                )
        require_redis()
        super().__init__(write_queue_bytes=write_queue_bytes, tier_timeout=tier_timeout)
        self._masked = mask_url(url)
        self._guard.breaker.describe = self._masked
        self._namespace = namespace
        self._ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self._decoder_lock = threading.Lock()
        self._decode_pool: ThreadPoolExecutor | None = None
        self._breaker = Breaker(
            breaker_failures, breaker_cooldown, self._masked, label="lmcache remote tier"
        )
        password = os.environ.get(PASSWORD_ENV) or None
        self._conn = RedisConnection(target, password, float(timeout), self._breaker)
        client: Any = None
        try:  # not through the breaker: a failure here is logged once, below
            client = self._conn.client()
            client.ping()
        except Exception as exc:
            if client is not None:
                self._conn.drop_connections(client)
            self._breaker.trip()
            logger.warning(
                "lmcache remote tier: %s unreachable at start (%r); running degraded (every "
                "lookup a miss) and retrying every %.1f s.",
                self._masked,
                exc,
                breaker_cooldown,
            )

    def __repr__(self) -> str:
        return f"RedisTier({self._masked!r}, namespace={self._namespace!r})"

    def _name(self, fingerprint: bytes, key: bytes) -> bytes:
        return f"{self._namespace}:{fingerprint.hex()}:{key.hex()}".encode("ascii")

    # ------------------------------------------------------------------ primitives

    def _exists(self, fingerprint: bytes, keys: Sequence[bytes]) -> list[bool]:
        names = [self._name(fingerprint, k) for k in keys]

        def op(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return list(pipe.execute())

        return [bool(n) for n in self._conn.run(op)]

    def _read_groups(self, requests: Sequence[ReadRequest]) -> list[tuple[int, int]]:
        groups: list[tuple[int, int]] = []
        start, size = 0, 0
        for i, request in enumerate(requests):
            nbytes = HEADER_BYTES + request.out.numel() * request.out.element_size()
            if i > start and size + nbytes > self.read_group_bytes:
                groups.append((start, i))
                start, size = i, 0
            size += nbytes
        groups.append((start, len(requests)))
        return groups

    def _read_into(
        self, fingerprint: bytes, requests: Sequence[ReadRequest]
    ) -> list[bool | CorruptChunk]:
        names = [self._name(fingerprint, r.key) for r in requests]
        results: list[bool | CorruptChunk] = [False] * len(requests)

        def decode(start: int, values: list[Any]) -> bool:
            """Verify and copy one group; ``False`` once a chunk is missing or bad."""
            for i, value in enumerate(values, start):
                outcome = self._decode_into(fingerprint, requests[i], value)
                results[i] = outcome
                if outcome is not True:
                    return False
            return True

        # Group k is verified and copied on a helper thread while group k + 1 is fetched
        # (hashing and socket reads both release the GIL).
        pending: Future[bool] | None = None
        try:
            for start, stop in self._read_groups(requests):

                def op(client: Any, group: list[bytes] = names[start:stop]) -> list[Any]:
                    pipe = client.pipeline(transaction=False)
                    for name in group:
                        pipe.get(name)
                    return list(pipe.execute())

                values = self._conn.run(op)
                if not progress():  # abandoned past its deadline: nobody reads the rest
                    return results
                if pending is not None and not pending.result():
                    return results
                pending = self._decoder().submit(decode, start, values)
                del values
            if pending is not None:
                pending.result()
        finally:
            # Never return (or raise) while the helper may still write into a caller's buffer.
            if pending is not None and not pending.cancel():
                wait([pending])
        return results

    def _decoder(self) -> ThreadPoolExecutor:
        with self._decoder_lock:
            if self._decode_pool is None:
                self._decode_pool = ThreadPoolExecutor(1, thread_name_prefix="lmcache-redis-read")
            return self._decode_pool

    @staticmethod
    def _decode_into(fingerprint: bytes, request: ReadRequest, value: Any) -> bool | CorruptChunk:
        if value is None:
            return False
        out = request.out
        shape = tuple(out.shape)
        if len(shape) != 3:
            raise ValueError(f"read buffer has shape {shape}, expected 3 dimensions")
        dst = _byte_view(out)
        try:
            if not isinstance(value, bytes):
                raise CorruptChunk(f"value is a {type(value).__name__}, expected bytes")
            data = memoryview(value)
            header = ChunkHeader.decode(data[:HEADER_BYTES])  # zero padding checked too

            def verify(payload: torch.Tensor | None) -> None:
                verify_chunk(
                    header,
                    payload,
                    key=request.key,
                    fingerprint=fingerprint,
                    shape=(shape[0], shape[1], shape[2]),
                    dtype=out.dtype,
                )

            verify(None)  # header fields first: never copy a value of another shape
            if len(data) != HEADER_BYTES + header.nbytes:
                raise CorruptChunk(
                    f"value is {len(data)} bytes, expected {HEADER_BYTES} + {header.nbytes}"
                )
            dst[:] = data[HEADER_BYTES:]
            verify(out)  # payload checksum, over the bytes as they now lie in the buffer
        except CorruptChunk as exc:
            return exc
        return True

    def _write(self, fingerprint: bytes, key: bytes, header: bytes, payload: memoryview) -> None:
        name = self._name(fingerprint, key)
        args: list[bytes] = [b"SET", name]
        tail: list[bytes] = []
        if self._ttl_ms is not None:
            tail = [b"PX", str(self._ttl_ms).encode("ascii")]
        nbytes = len(header) + payload.nbytes
        pieces = [b"*%d\r\n" % (len(args) + 1 + len(tail))]
        pieces += [b"$%d\r\n%s\r\n" % (len(a), a) for a in args]
        parts: list[bytes | memoryview] = [
            b"".join([*pieces, b"$%d\r\n" % nbytes]),
            header,
            payload,
            b"".join([b"\r\n", *(b"$%d\r\n%s\r\n" % (len(a), a) for a in tail)]),
        ]

        def op(client: Any) -> None:
            from redis.exceptions import ResponseError

            if is_cluster(client):
                cluster: Any = client  # partly untyped in redis-py
                pool = cluster.get_redis_connection(cluster.get_node_from_key(name)).connection_pool
                try:
                    send_packed(pool, parts)
                except ResponseError as exc:
                    if not str(exc).startswith(("MOVED", "ASK")):
                        raise
                    # The slot moved: let redis-py follow the redirect and refresh its map.
                    value = b"".join([header, payload])
                    client.set(name, value, px=self._ttl_ms)
                return
            send_packed(client.connection_pool, parts)

        self._conn.run(op)

    def _delete(self, fingerprint: bytes, key: bytes) -> None:
        name = self._name(fingerprint, key)
        self._conn.run(lambda client: client.unlink(name))

    def _clear(self, fingerprint: bytes | None) -> None:
        middle = "*" if fingerprint is None else fingerprint.hex() + ":*"
        pattern = f"{self._namespace}:{middle}"

        def op(client: Any) -> None:
            if is_cluster(client):
                cluster: Any = client  # partly untyped in redis-py
                nodes = [cluster.get_redis_connection(n) for n in cluster.get_primaries()]
            else:
                nodes = [client]
            for node in nodes:
                batch: list[bytes] = []
                for name in node.scan_iter(match=pattern, count=_SCAN_COUNT):
                    batch.append(name)
                    if len(batch) >= _SCAN_COUNT:
                        unlink_names(node, batch)
                        batch = []
                if batch:
                    unlink_names(node, batch)

        self._conn.run(op)

    def _close(self) -> None:
        with self._decoder_lock:
            pool, self._decode_pool = self._decode_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._conn.close()

    @property
    def breaker_open(self) -> bool:
        """Whether the circuit breaker is open (operations are misses without network)."""
        return self._breaker.is_open

    @property
    def url(self) -> str:
        """The URL with its password masked."""
        return self._masked
