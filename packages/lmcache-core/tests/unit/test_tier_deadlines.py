# SPDX-License-Identifier: Apache-2.0
"""A hung tier is a miss within its deadline, never a held thread or a reused buffer.

A disk folder on a hung mount is played by chunk files replaced with FIFOs (``os.mkfifo``): an
``open`` for reading blocks until someone opens the other end, as a read on a hung NFS mount
does. A Redis server that accepts connections and never answers is played by a TCP listener
that accepts and then says nothing. Every FIFO is opened from the other end in teardown, so no
reader thread outlives its test.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache.memory import HostMemoryPool
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers.chunk_format import fingerprint_digest
from lmcache.tiers.disk.tier import DiskTier
from lmcache.tiers.lower_tier import ReadRequest
from lmcache.tiers.tier_guard import Breaker, TierGuard, TierTimeout, TierUnavailable, progress

FP = fingerprint_digest(b"model-deadlines")
SHAPE = (2, 4, 32)
DTYPE = torch.float32
DEADLINE = 0.4
MARGIN = 0.6  # scheduling slack on a loaded 2-core machine


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"deadline"


def _values(key: bytes) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return torch.randn(SHAPE, generator=gen)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class Fifos:
    """Chunk files replaced by FIFOs; :meth:`release` opens every one from the writing side
    (with nothing written: the blocked reader fails, as after an I/O error)."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def replace(self, path: Path) -> None:
        path.unlink()
        os.mkfifo(path, 0o600)
        self.paths.append(path)

    def release(self) -> None:
        for path in self.paths:
            with contextlib.suppress(OSError):  # ENXIO: nobody reads it now
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture
def fifos() -> Iterator[Fifos]:
    f = Fifos()
    yield f
    f.release()


@pytest.fixture
def pool() -> HostMemoryPool:
    return HostMemoryPool(1 << 20, pin=False, slab_bytes=1 << 20)


@pytest.fixture
def disk(tmp_path: Path, pool: HostMemoryPool) -> Iterator[DiskTier]:
    tier = DiskTier(str(tmp_path / "kv"), 1 << 24, fsync=False, tier_timeout=DEADLINE)
    metrics = LMCacheMetrics()
    for i in range(4):
        lease = pool.allocate(SHAPE, DTYPE)
        assert lease is not None
        with lease:
            lease.tensor.copy_(_values(_key(i)))
            assert tier.submit_write(FP, _key(i), lease, None, metrics)
    assert tier.flush(10)
    yield tier
    tier.close()


def _file(tier: DiskTier, i: int) -> Path:
    return Path(tier.path) / FP.hex() / f"{_key(i).hex()}.lmc"


def _read(
    tier: DiskTier | object, pool: HostMemoryPool, keys: list[bytes], metrics: LMCacheMetrics
) -> tuple[int, float, list[torch.Tensor]]:
    """``read_into`` as the cascade calls it (into leased pool buffers); the leases are released
    right after, as the cascade does with the buffers of chunks not read."""
    leases = [pool.allocate(SHAPE, DTYPE) for _ in keys]
    assert all(lease is not None for lease in leases)
    requests = [ReadRequest(k, lease.tensor, lease) for k, lease in zip(keys, leases, strict=True)]
    for lease in leases:
        lease.tensor.fill_(float("nan"))
    start = time.monotonic()
    done = tier.read_into(FP, requests, metrics)  # type: ignore[attr-defined]
    took = time.monotonic() - start
    outs = [lease.tensor.clone() for lease in leases]
    for lease in leases:
        lease.release()
    return done, took, outs


def _wait(cond: object, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


# ------------------------------------------------------------------ the disk tier


def test_a_stalled_disk_read_is_a_miss_within_the_deadline_and_holds_its_buffers(
    disk: DiskTier, pool: HostMemoryPool, fifos: Fifos
) -> None:
    metrics = LMCacheMetrics()
    fifos.replace(_file(disk, 1))
    assert disk.contains(FP, [_key(i) for i in range(4)], metrics) == [True] * 4  # the index

    done, took, _ = _read(disk, pool, [_key(0), _key(1), _key(2)], metrics)
    assert done == 0 and took < DEADLINE + MARGIN  # a miss for this request, in time
    assert metrics.value("tier_timeouts") == 1 and metrics.value("tier_errors") == 1
    assert disk.guard.stuck == 1
    # The caller released its leases, but the stuck read still holds shares: the three
    # buffers are not handed out again while it may write them.
    assert pool.used_bytes == 3 * SHAPE[0] * SHAPE[1] * SHAPE[2] * 4

    # Meanwhile another read is served, on another thread, bit for bit.
    done, took, outs = _read(disk, pool, [_key(3)], metrics)
    assert done == 1 and took < MARGIN
    assert torch.equal(_bits(outs[0]), _bits(_values(_key(3))))

    fifos.release()  # the "mount" answers: the abandoned read ends, its buffers go back
    assert _wait(lambda: disk.guard.stuck == 0)
    assert _wait(lambda: pool.used_bytes == 0)
    threads = [t for t in threading.enumerate() if t.name == "lmcache-disk-read"]
    assert threads and all(t.daemon for t in threads)  # never holds up the interpreter's exit


def test_repeated_timeouts_back_off_with_one_line_then_probe(
    disk: DiskTier, pool: HostMemoryPool, fifos: Fifos, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = LMCacheMetrics()
    disk.guard.breaker.cooldown = 1.0
    fifos.replace(_file(disk, 0))
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        for _ in range(3):
            assert _read(disk, pool, [_key(0)], metrics)[0] == 0
        assert disk.guard.breaker.is_open
        # Backing off: even a healthy chunk is a miss at once, without a thread or a timeout.
        threads = disk.guard.threads
        done, took, _ = _read(disk, pool, [_key(2)], metrics)
        assert done == 0 and took < 0.05
        assert disk.contains(FP, [_key(2)], metrics) == [False]
        assert disk.guard.threads == threads
        assert metrics.value("tier_timeouts") == 3 and metrics.value("tier_errors") == 5
        opened = [r for r in caplog.records if "circuit breaker open after" in r.getMessage()]
        assert len(opened) == 1 and disk.path in opened[0].getMessage()
        assert len(caplog.records) == 2  # the first timeout, then the back-off: no line per miss
        time.sleep(1.1)
        done, _, outs = _read(disk, pool, [_key(2)], metrics)  # the probe: answered in time
        assert done == 1 and torch.equal(_bits(outs[0]), _bits(_values(_key(2))))
        assert not disk.guard.breaker.is_open
        assert any("answers again" in r.getMessage() for r in caplog.records)


def test_stuck_reads_are_bounded_per_tier(
    disk: DiskTier, pool: HostMemoryPool, fifos: Fifos, caplog: pytest.LogCaptureFixture
) -> None:
    """Timeouts separated by successes never open the breaker, but once ``max_stuck`` reads are
    still stuck the tier backs off rather than taking another thread."""
    metrics = LMCacheMetrics()
    fifos.replace(_file(disk, 0))
    for i in range(disk.guard.max_stuck):
        assert _read(disk, pool, [_key(0)], metrics)[0] == 0
        if i < disk.guard.max_stuck - 1:
            assert _read(disk, pool, [_key(3)], metrics)[0] == 1  # resets the consecutive count
    assert disk.guard.stuck == disk.guard.max_stuck and not disk.guard.breaker.is_open
    threads = disk.guard.threads
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        done, took, _ = _read(disk, pool, [_key(3)], metrics)
    assert done == 0 and took < 0.05 and disk.guard.threads == threads
    assert disk.guard.breaker.is_open
    assert any("stuck past their deadline" in r.getMessage() for r in caplog.records)


def test_a_fifo_under_a_chunk_name_never_blocks_the_start_up_scan(
    disk: DiskTier, fifos: Fifos
) -> None:
    fifos.replace(_file(disk, 2))
    made: list[DiskTier] = []
    starter = threading.Thread(
        target=lambda: made.append(DiskTier(disk.path, 1 << 24, fsync=False)), daemon=True
    )
    starter.start()
    starter.join(10)
    assert not starter.is_alive(), "the scan blocked on a FIFO"
    (fresh,) = made
    try:
        assert len(fresh) == 3 and not _file(disk, 2).exists()  # not a regular file: deleted
    finally:
        fresh.close()


def test_without_a_deadline_reads_run_on_the_callers_thread(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path / "kv"), 1 << 24, fsync=False, tier_timeout=None)
    try:
        seen: list[str] = []
        tier._exists = lambda fp, keys: seen.append(threading.current_thread().name) or [False]  # type: ignore[method-assign]
        assert tier.contains(FP, [_key(0)], LMCacheMetrics()) == [False]
        assert seen == [threading.current_thread().name]
    finally:
        tier.close()


# ------------------------------------------------------------------ the guard itself


def test_a_long_call_that_keeps_progressing_is_never_cut() -> None:
    guard = TierGuard("disk", 0.3)
    try:

        def slow() -> int:
            for _ in range(8):  # 0.8 s in all, never 0.3 s without progress
                time.sleep(0.1)
                assert progress()
            return 42

        assert guard.call(slow) == 42
        assert not guard.breaker.is_open
    finally:
        guard.close()


def test_an_abandoned_call_learns_it_and_stops() -> None:
    guard = TierGuard("disk", 0.2)
    gate = threading.Event()
    steps: list[bool] = []

    def stalls() -> None:
        gate.wait(10)
        steps.append(progress())

    try:
        with pytest.raises(TierTimeout):
            guard.call(stalls)
        assert guard.stuck == 1
        gate.set()
        assert _wait(lambda: guard.stuck == 0)
        assert steps == [False]
    finally:
        gate.set()
        guard.close()


def test_breaker_trial_and_close() -> None:
    breaker = Breaker(2, 0.2, "thing", label="lmcache test tier", failure="timeouts")
    assert breaker.admit() is False
    breaker.record(False, False)
    breaker.record(False, False)
    with pytest.raises(TierUnavailable, match="thing is unavailable"):
        breaker.admit()
    time.sleep(0.25)
    assert breaker.admit() is True  # the one trial
    with pytest.raises(TierUnavailable):
        breaker.admit()  # a trial is running
    breaker.record(True, True)
    assert not breaker.is_open and breaker.admit() is False


# ------------------------------------------------------------------ Redis that never answers


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def test_redis_that_accepts_and_never_answers_is_a_miss_within_the_deadline(
    silent: SilentServer, pool: HostMemoryPool
) -> None:
    """The socket timeout (``remote_timeout``) is long here; the tier deadline cuts first, and
    the abandoned thread ends with the socket timeout: never held for ever."""
    pytest.importorskip("redis", reason="redis-py not installed: pip install 'redis>=5'")
    from lmcache.tiers.redis.tier import RedisTier

    metrics = LMCacheMetrics()
    tier = RedisTier(silent.url, timeout=1.5, tier_timeout=DEADLINE, breaker_cooldown=0.0)
    try:
        assert tier.breaker_open  # its start-up ping got no answer: degraded, not an error
        start = time.monotonic()
        assert tier.contains(FP, [_key(0), _key(1)], metrics) == [False, False]
        assert time.monotonic() - start < DEADLINE + MARGIN
        done, took, _ = _read(tier, pool, [_key(0), _key(1)], metrics)
        assert done == 0 and took < DEADLINE + MARGIN
        assert metrics.value("tier_timeouts") >= 1
        assert _wait(lambda: tier.guard.stuck == 0, 5.0)  # released by the socket timeout
        assert _wait(lambda: pool.used_bytes == 0, 5.0)
    finally:
        tier.close()


def test_redis_without_a_tier_deadline_is_bounded_by_its_socket_timeout(
    silent: SilentServer,
) -> None:
    pytest.importorskip("redis", reason="redis-py not installed: pip install 'redis>=5'")
    from lmcache.tiers.redis.tier import RedisTier

    metrics = LMCacheMetrics()
    tier = RedisTier(
        silent.url, timeout=0.3, tier_timeout=None, breaker_failures=2, breaker_cooldown=0.0
    )
    try:
        for _ in range(3):
            start = time.monotonic()
            assert tier.contains(FP, [_key(0)], metrics) == [False]
            assert time.monotonic() - start < 0.3 + MARGIN
        assert metrics.value("tier_errors") == 3 and metrics.value("tier_timeouts") == 0
    finally:
        tier.close()


def test_fifo_open_from_the_writing_side_needs_a_reader(tmp_path: Path) -> None:
    """The teardown's way of unblocking readers does not block when nobody reads."""
    path = tmp_path / "f"
    os.mkfifo(path)
    with pytest.raises(OSError) as info:
        os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    assert info.value.errno == errno.ENXIO


def test_a_clear_that_hangs_returns_within_the_deadline(disk: DiskTier) -> None:
    """``reset_prefix_cache`` clears every tier: a hung one must not hold it."""
    metrics = LMCacheMetrics()
    gate = threading.Event()
    real = disk._clear

    def hangs(fingerprint: bytes | None) -> None:
        gate.wait(30)
        real(fingerprint)

    disk._clear = hangs  # type: ignore[method-assign]
    try:
        start = time.monotonic()
        disk.clear(FP, metrics)
        assert time.monotonic() - start < DEADLINE + MARGIN
        assert metrics.value("tier_timeouts") == 1
    finally:
        gate.set()
    assert _wait(lambda: len(disk) == 0)  # the abandoned clear still finishes
