# SPDX-License-Identifier: Apache-2.0
"""RedisTier against real redis-server processes (lmcache.testing.redis_server), no fakes.

Chunks are small (``[2, 4, 16]``) random tensors; reads go into NaN-poisoned buffers and are
compared bit for bit with what was stored. Most tests share one server and use their own
namespace; tests that stop, pause or restart a server start their own.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import pytest
import torch

from lmcache.config import ConfigError
from lmcache.memory import HostMemoryPool
from lmcache.metrics import LMCacheMetrics
from lmcache.testing.redis_server import (
    RedisClusterServer,
    RedisSentinel,
    RedisServer,
    redis_server_path,
)
from lmcache.tiers.chunk_format import HEADER_BYTES, fingerprint_digest
from lmcache.tiers.lower_tier import ReadRequest

redis = pytest.importorskip("redis", reason="redis-py not installed: pip install 'redis>=5'")
from lmcache.tiers.redis.tier import PASSWORD_ENV, RedisTier, mask_url  # noqa: E402

pytestmark = pytest.mark.skipif(
    redis_server_path() is None,
    reason="redis-server/valkey-server not installed (Debian: apt-get install redis-server)",
)

SHAPE = (2, 4, 16)
FP_A = fingerprint_digest(b"model-a")
FP_B = fingerprint_digest(b"model-b")
PASSWORD = "s3cr:et/pa@ss word"


def _keys(n: int, tag: str = "") -> list[bytes]:
    return [uuid.uuid5(uuid.NAMESPACE_OID, f"{tag}{i}").bytes for i in range(n)]


def _chunks(n: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen).to(dtype) for _ in range(n)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _store(
    tier: RedisTier,
    fp: bytes,
    keys: Sequence[bytes],
    chunks: Sequence[torch.Tensor],
    metrics: LMCacheMetrics,
) -> None:
    pool = HostMemoryPool(1 << 20, pin=False, slab_bytes=1 << 20)
    for key, chunk in zip(keys, chunks, strict=True):
        lease = pool.allocate(chunk.shape, chunk.dtype)
        assert lease is not None
        with lease:
            lease.tensor.copy_(chunk)
            assert tier.submit_write(fp, key, lease, None, metrics)
    assert tier.flush(10.0)


def _read(
    tier: RedisTier,
    fp: bytes,
    keys: Sequence[bytes],
    metrics: LMCacheMetrics,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[int, list[torch.Tensor]]:
    outs = [torch.full(SHAPE, float("nan"), dtype=dtype) for _ in keys]
    done = tier.read_into(fp, [ReadRequest(k, o) for k, o in zip(keys, outs, strict=True)], metrics)
    return done, outs


def _name(namespace: str, fp: bytes, key: bytes) -> bytes:
    return f"{namespace}:{fp.hex()}:{key.hex()}".encode()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def client(server: RedisServer) -> Iterator[redis.Redis]:
    conn = redis.Redis(host="127.0.0.1", port=server.port, protocol=2)
    yield conn
    conn.close()


@pytest.fixture
def tier(server: RedisServer, namespace: str) -> Iterator[RedisTier]:
    t = RedisTier(server.url, namespace=namespace)
    yield t
    t.close()


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_bit_exact(tier: RedisTier, dtype: torch.dtype) -> None:
    metrics = LMCacheMetrics()
    keys, chunks = _keys(5, str(dtype)), _chunks(5, dtype, seed=1)
    _store(tier, FP_A, keys, chunks, metrics)
    assert metrics.value("remote_stored_chunks") == 5
    assert tier.contains(FP_A, keys, metrics) == [True] * 5
    done, outs = _read(tier, FP_A, keys, metrics, dtype)
    assert done == 5
    for out, chunk in zip(outs, chunks, strict=True):
        assert torch.equal(_bits(out), _bits(chunk))
    assert metrics.value("remote_hit_chunks") == 5
    assert metrics.value("tier_errors") == 0
    # The other model's fingerprint sees nothing; a missing key ends the run.
    assert tier.contains(FP_B, keys, metrics) == [False] * 5
    missing = _keys(1, "missing")
    assert _read(tier, FP_A, [*keys[:2], *missing, keys[3]], metrics, dtype)[0] == 2


def test_read_groups_bound_bytes(tier: RedisTier) -> None:
    metrics = LMCacheMetrics()
    keys, chunks = _keys(7, "groups"), _chunks(7, seed=2)
    _store(tier, FP_A, keys, chunks, metrics)
    chunk_bytes = HEADER_BYTES + chunks[0].numel() * chunks[0].element_size()
    tier.read_group_bytes = 2 * chunk_bytes
    assert tier._read_groups([ReadRequest(k, c) for k, c in zip(keys, chunks, strict=True)]) == [
        (0, 2),
        (2, 4),
        (4, 6),
        (6, 7),
    ]
    done, outs = _read(tier, FP_A, keys, metrics)
    assert done == 7
    assert all(torch.equal(_bits(o), _bits(c)) for o, c in zip(outs, chunks, strict=True))


def test_bad_chunk_in_a_later_group_ends_the_run_there(
    tier: RedisTier, client: redis.Redis
) -> None:
    """Groups are fetched while the previous one is verified: a bad chunk in group 3 still
    stops the run exactly before it, and nothing after it is reported."""
    metrics = LMCacheMetrics()
    keys, chunks = _keys(7, "overlap"), _chunks(7, seed=5)
    _store(tier, FP_A, keys, chunks, metrics)
    chunk_bytes = HEADER_BYTES + chunks[0].numel() * chunks[0].element_size()
    tier.read_group_bytes = 2 * chunk_bytes
    name = tier._name(FP_A, keys[5])
    value = bytearray(client.get(name))
    value[-3] ^= 0x20
    client.set(name, bytes(value))
    done, outs = _read(tier, FP_A, keys, metrics)
    assert done == 5
    assert all(torch.equal(_bits(o), _bits(c)) for o, c in zip(outs[:5], chunks[:5], strict=True))
    assert metrics.value("checksum_failures") == 1 and not client.exists(name)


def _stat(client: redis.Redis, section: str, field: str) -> int:
    info = client.info(section)
    value = info[field]
    return int(value["calls"]) if isinstance(value, dict) else int(value)


def test_batches_are_one_pipelined_round_trip(tier: RedisTier, client: redis.Redis) -> None:
    metrics = LMCacheMetrics()
    n = 16
    keys = _keys(n, "pipeline")
    _store(tier, FP_A, keys, _chunks(n, seed=3), metrics)
    tier.contains(FP_A, keys[:1], metrics)  # warm: the pool holds a connection

    def reads_and_calls(command: str) -> tuple[int, int]:
        reads = _stat(client, "stats", "total_reads_processed")
        stats = client.info("commandstats")
        calls = int(stats.get(f"cmdstat_{command}", {"calls": 0})["calls"])
        return reads, calls

    for command, run in (
        ("exists", lambda: tier.contains(FP_A, keys, metrics)),
        ("get", lambda: _read(tier, FP_A, keys, metrics)[0]),
    ):
        reads0, calls0 = reads_and_calls(command)
        assert run() in ([True] * n, n)
        reads1, calls1 = reads_and_calls(command)
        assert calls1 - calls0 == n
        # Each INFO pair costs 2 reads of the checking client; a loop would cost n reads.
        tier_reads = reads1 - reads0 - 2
        assert 1 <= tier_reads <= 2, (command, tier_reads)


def test_key_names_namespace_fingerprint_and_ttl(
    server: RedisServer, namespace: str, client: redis.Redis
) -> None:
    metrics = LMCacheMetrics()
    keys = _keys(2, "names")
    with_ttl = RedisTier(server.url, namespace=namespace, ttl=100.0)
    try:
        _store(with_ttl, FP_A, keys, _chunks(2), metrics)
    finally:
        with_ttl.close()
    names = sorted(client.scan_iter(match=f"{namespace}:*"))
    assert names == sorted(_name(namespace, FP_A, k) for k in keys)
    for name in names:
        assert 90_000 < client.pttl(name) <= 100_000
    no_ttl = RedisTier(server.url, namespace=namespace)
    try:
        _store(no_ttl, FP_A, keys[:1], _chunks(1), metrics)
    finally:
        no_ttl.close()
    assert client.pttl(_name(namespace, FP_A, keys[0])) == -1


def test_namespaces_and_clear_by_fingerprint(server: RedisServer, client: redis.Redis) -> None:
    metrics = LMCacheMetrics()
    ns_a, ns_b = f"a{uuid.uuid4().hex[:8]}", f"b{uuid.uuid4().hex[:8]}"
    tier_a = RedisTier(server.url, namespace=ns_a)
    tier_b = RedisTier(server.url, namespace=ns_b)
    try:
        keys = _keys(1500, "clear")  # more than one SCAN/UNLINK batch
        small = keys[:3]
        _store(tier_a, FP_A, keys, _chunks(1) * len(keys), metrics)
        _store(tier_a, FP_B, small, _chunks(3), metrics)
        _store(tier_b, FP_A, small, _chunks(3), metrics)
        assert tier_b.contains(FP_A, keys[3:6], metrics) == [False] * 3
        tier_a.clear(FP_A, metrics)
        assert tier_a.contains(FP_A, small, metrics) == [False] * 3
        assert len(list(client.scan_iter(match=f"{ns_a}:{FP_A.hex()}:*"))) == 0
        assert tier_a.contains(FP_B, small, metrics) == [True] * 3
        assert tier_b.contains(FP_A, small, metrics) == [True] * 3
        tier_a.clear(None, metrics)
        assert list(client.scan_iter(match=f"{ns_a}:*")) == []
        assert tier_b.contains(FP_A, small, metrics) == [True] * 3
        assert metrics.value("tier_errors") == 0
    finally:
        tier_a.close()
        tier_b.close()


def test_concurrent_readers_and_writer(tier: RedisTier) -> None:
    metrics = LMCacheMetrics()
    keys, chunks = _keys(40, "threads"), _chunks(40, seed=4)
    _store(tier, FP_A, keys[:20], chunks[:20], metrics)
    failures: list[str] = []

    def reader() -> None:
        for _ in range(20):
            done, outs = _read(tier, FP_A, keys[:20], metrics)
            if done != 20 or not all(
                torch.equal(_bits(o), _bits(c)) for o, c in zip(outs, chunks, strict=False)
            ):
                failures.append(f"read {done}")

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    _store(tier, FP_A, keys[20:], chunks[20:], metrics)
    for t in threads:
        t.join()
    assert failures == []
    assert _read(tier, FP_A, keys, metrics)[0] == 40


# ---------------------------------------------------------------------- corruption


def _flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x10
    return bytes(out)


CORRUPTIONS = [
    "payload_bit",
    "header_bit",
    "padding_bit",
    "truncate",
    "swap",
    "other_fingerprint",
    "garbage",
]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corruption_is_detected_counted_and_deleted(
    server: RedisServer, namespace: str, client: redis.Redis, kind: str
) -> None:
    metrics = LMCacheMetrics()
    tier = RedisTier(server.url, namespace=namespace)
    try:
        keys, chunks = _keys(4, kind), _chunks(4, seed=5)
        _store(tier, FP_A, keys, chunks, metrics)
        names = [_name(namespace, FP_A, k) for k in keys]
        value = client.get(names[2])
        assert isinstance(value, bytes)
        if kind == "payload_bit":
            client.set(names[2], _flip(value, len(value) - 7))
        elif kind == "header_bit":
            client.set(names[2], _flip(value, 40))
        elif kind == "padding_bit":
            client.set(names[2], _flip(value, HEADER_BYTES - 1))
        elif kind == "truncate":
            client.set(names[2], value[:-2])
        elif kind == "swap":
            other = client.get(names[3])
            assert isinstance(other, bytes)
            client.set(names[2], other)
            client.set(names[3], value)
        elif kind == "other_fingerprint":
            _store(tier, FP_B, keys[2:3], chunks[2:3], metrics)
            foreign = client.get(_name(namespace, FP_B, keys[2]))
            assert isinstance(foreign, bytes)
            client.set(names[2], foreign)
        else:
            client.set(names[2], b"not a chunk")
        done, outs = _read(tier, FP_A, keys, metrics)
        assert done == 2
        assert all(torch.equal(_bits(o), _bits(c)) for o, c in zip(outs[:2], chunks, strict=False))
        assert metrics.value("checksum_failures") == 1
        assert client.exists(names[2]) == 0  # the bad entry is deleted
        if kind == "swap":
            assert _read(tier, FP_A, keys[3:], metrics)[0] == 0
            assert metrics.value("checksum_failures") == 2
            assert client.exists(names[3]) == 0
        assert metrics.value("remote_hit_chunks") == 2
    finally:
        tier.close()


# ---------------------------------------------------------------------- failures


class _ConnectCounter:
    """Counts TCP connects made through ``socket.socket.connect``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = socket.socket.connect

        def connect(sock: socket.socket, address: object) -> None:
            self.count += 1
            original(sock, address)  # type: ignore[arg-type]

        monkeypatch.setattr(socket.socket, "connect", connect)


def test_server_stopped_then_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = LMCacheMetrics()
    keys, chunks = _keys(3, "restart"), _chunks(3, seed=6)
    with RedisServer() as srv:
        tier = RedisTier(srv.url, timeout=0.5, breaker_failures=2, breaker_cooldown=1.0)
        try:
            _store(tier, FP_A, keys, chunks, metrics)
            assert _read(tier, FP_A, keys, metrics)[0] == 3
            srv.stop()
            counter = _ConnectCounter(monkeypatch)
            start = time.monotonic()
            for _ in range(10):
                assert tier.contains(FP_A, keys, metrics) == [False] * 3
                assert _read(tier, FP_A, keys, metrics)[0] == 0
            _store(tier, FP_A, keys, chunks, metrics)  # writes fail quietly too
            assert time.monotonic() - start < 2.0
            assert tier.breaker_open
            assert counter.count <= 2  # only until the breaker opened
            assert metrics.value("tier_errors") >= 20
            srv.start()  # same port, empty
            time.sleep(1.1)  # the cool-down
            _store(tier, FP_A, keys, chunks, metrics)  # the trial operation
            assert not tier.breaker_open
            done, outs = _read(tier, FP_A, keys, metrics)
            assert done == 3
            assert all(torch.equal(_bits(o), _bits(c)) for o, c in zip(outs, chunks, strict=True))
        finally:
            tier.close()


def test_unreachable_at_start_is_degraded_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    metrics = LMCacheMetrics()
    keys, chunks = _keys(2, "late"), _chunks(2, seed=7)
    srv = RedisServer()
    try:
        with caplog.at_level(logging.WARNING, logger="lmcache"):
            tier = RedisTier(srv.url, timeout=0.5, breaker_cooldown=0.5)
        try:
            assert len(caplog.records) == 1 and "unreachable at start" in caplog.text
            start = time.monotonic()
            assert tier.contains(FP_A, keys, metrics) == [False, False]
            assert time.monotonic() - start < 0.2  # breaker open: no network
            srv.start()
            time.sleep(0.6)
            _store(tier, FP_A, keys, chunks, metrics)
            assert _read(tier, FP_A, keys, metrics)[0] == 2
        finally:
            tier.close()
    finally:
        srv.cleanup()


def test_paused_server_times_out_within_bound() -> None:
    metrics = LMCacheMetrics()
    timeout, margin = 0.5, 0.75
    keys, chunks = _keys(2, "pause"), _chunks(2, seed=8)
    with RedisServer() as srv:
        tier = RedisTier(srv.url, timeout=timeout, breaker_failures=3, breaker_cooldown=1.0)
        try:
            _store(tier, FP_A, keys, chunks, metrics)
            srv.pause()
            try:
                for op in (
                    lambda: tier.contains(FP_A, keys, metrics),
                    lambda: _read(tier, FP_A, keys, metrics)[0],
                    lambda: tier.contains(FP_A, keys, metrics),
                    lambda: _read(tier, FP_A, keys, metrics)[0],  # breaker open: at once
                ):
                    start = time.monotonic()
                    assert op() in ([False, False], 0)
                    assert time.monotonic() - start < timeout + margin
                assert tier.breaker_open
                start = time.monotonic()
                _store(tier, FP_A, keys, chunks, metrics)  # dropped quietly, not blocking
                assert time.monotonic() - start < timeout + margin
            finally:
                srv.resume()
            time.sleep(1.1)
            done, outs = _read(tier, FP_A, keys, metrics)
            assert done == 2
            assert all(torch.equal(_bits(o), _bits(c)) for o, c in zip(outs, chunks, strict=True))
        finally:
            tier.close()


# ---------------------------------------------------------------------- auth and URLs


def test_password_works_and_never_leaks(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = LMCacheMetrics()
    keys, chunks = _keys(2, "auth"), _chunks(2, seed=9)
    with caplog.at_level(logging.DEBUG), RedisServer(password=PASSWORD) as srv:
        assert "%" in srv.url  # the password is URL-quoted
        tier = RedisTier(srv.url, timeout=0.5)
        try:
            assert PASSWORD not in repr(tier) and "***" in repr(tier)
            assert PASSWORD not in tier.url
            _store(tier, FP_A, keys, chunks, metrics)
            assert _read(tier, FP_A, keys, metrics)[0] == 2
        finally:
            tier.close()
        # From the environment, with a password-less URL.
        monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
        env_tier = RedisTier(f"redis://127.0.0.1:{srv.port}/0", timeout=0.5)
        try:
            assert _read(env_tier, FP_A, keys, metrics)[0] == 2
        finally:
            env_tier.close()
        monkeypatch.delenv(PASSWORD_ENV)
        # A wrong password: degraded, logged, and the wrong password is not shown either.
        wrong = "wr0ng-Secret"
        bad = RedisTier(f"redis://default:{wrong}@127.0.0.1:{srv.port}/0", timeout=0.5)
        try:
            assert bad.contains(FP_A, keys, metrics) == [False, False]
            assert wrong not in repr(bad)
        finally:
            bad.close()
        with pytest.raises(ConfigError) as err:
            RedisTier(f"redis://user:{wrong}@127.0.0.1:notaport/0")
    text = caplog.text
    assert "unreachable at start" in text
    for secret in (PASSWORD, wrong, "s3cr"):
        assert secret not in text
        assert secret not in str(err.value)
    assert "user:***@" in str(err.value)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://u:hunter2@host:6379", "unknown scheme"),
        ("redis:6379", "no scheme"),
        ("redis://:hunter2@host:99999/0", "port"),
        ("redis://:hunter2@host:6379/zero", "db"),
        ("redis://:hunter2@/0", "no host"),
        ("redis+cluster://:hunter2@host:6379/3", "cluster"),
        ("redis+sentinel://:hunter2@host:26379", "service name"),
        ("redis://:hunter2@host:6379/0?socket_timeout=5", "query parameter"),
        ("redis://hunter2@a,b:6379/0", "several hosts"),
        ("unix://:hunter2@", "socket path"),
        ("redis://h:1/0?password=hunter2&x=1", "query parameter"),
    ],
)
def test_bad_urls_raise_config_error_with_masked_password(url: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        RedisTier(url)
    message = str(err.value)
    assert "remote_url" in message and problem in message and "redis://" in message
    assert "hunter2" not in message
    assert "***" in message or "hunter2" not in url


def test_mask_url() -> None:
    assert mask_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert mask_url("rediss://:p@w/d@h:1") == "rediss://:***@h:1"
    assert mask_url("redis://pw@h") == "redis://***@h"
    assert mask_url("unix:///s.sock?db=1&password=pw") == "unix:///s.sock?db=1&password=***"
    assert mask_url("redis://h:1/0") == "redis://h:1/0"


def test_valkey_scheme_and_unix_socket(namespace: str) -> None:
    metrics = LMCacheMetrics()
    keys, chunks = _keys(2, "unix"), _chunks(2, seed=10)
    with RedisServer(unixsocket=True) as srv:
        for url in (srv.url.replace("redis://", "valkey://"), srv.unix_url):
            tier = RedisTier(url, namespace=namespace)
            try:
                _store(tier, FP_A, keys, chunks, metrics)
                assert _read(tier, FP_A, keys, metrics)[0] == 2
                tier.clear(None, metrics)
                assert tier.contains(FP_A, keys, metrics) == [False, False]
            finally:
                tier.close()
        assert metrics.value("tier_errors") == 0


def test_sentinel_round_trip(namespace: str) -> None:
    metrics = LMCacheMetrics()
    keys, chunks = _keys(3, "sentinel"), _chunks(3, seed=11)
    with RedisServer(password=PASSWORD) as master, RedisSentinel(master) as sentinel:
        tier = RedisTier(sentinel.url, namespace=namespace, timeout=1.0)
        try:
            assert PASSWORD not in repr(tier)
            _store(tier, FP_A, keys, chunks, metrics)
            assert master.command("EXISTS", _name(namespace, FP_A, keys[0])) == 1
            done, outs = _read(tier, FP_A, keys, metrics)
            assert done == 3
            assert all(torch.equal(_bits(o), _bits(c)) for o, c in zip(outs, chunks, strict=True))
        finally:
            tier.close()
    assert metrics.value("tier_errors") == 0


# ---------------------------------------------------------------------- cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServer]:
    nodes = RedisClusterServer(3)
    try:
        nodes.start()
    except RuntimeError as exc:
        nodes.cleanup()
        pytest.skip(f"no local Redis Cluster: {exc}")
    yield nodes
    nodes.cleanup()


def test_cluster_round_trip_and_clear(cluster: RedisClusterServer, namespace: str) -> None:
    metrics = LMCacheMetrics()
    keys, chunks = _keys(24, "cluster"), _chunks(24, seed=12)
    tier = RedisTier(cluster.url, namespace=namespace)
    try:
        _store(tier, FP_A, keys, chunks, metrics)
        _store(tier, FP_B, keys[:4], chunks[:4], metrics)
        per_node = [int(n.command("DBSIZE")) for n in cluster.nodes]  # type: ignore[call-overload]
        assert sum(per_node) == 28 and sum(1 for n in per_node if n) >= 2  # spread over slots
        assert tier.contains(FP_A, keys, metrics) == [True] * 24
        done, outs = _read(tier, FP_A, keys, metrics)
        assert done == 24
        assert all(torch.equal(_bits(o), _bits(c)) for o, c in zip(outs, chunks, strict=True))
        tier.clear(FP_A, metrics)
        assert tier.contains(FP_A, keys, metrics) == [False] * 24
        assert tier.contains(FP_B, keys[:4], metrics) == [True] * 4
        tier.clear(None, metrics)
        assert sum(int(n.command("DBSIZE")) for n in cluster.nodes) == 0  # type: ignore[call-overload]
        assert metrics.value("tier_errors") == 0
    finally:
        tier.close()
