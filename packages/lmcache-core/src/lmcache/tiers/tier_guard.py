# SPDX-License-Identifier: Apache-2.0
"""Deadlines and back-off for the tiers below the CPU one (local disk, Redis/Valkey).

A disk folder on a hung network mount, or a server that accepts a connection and never answers,
must cost a request at most one deadline and never hold a thread that other requests need:

* :class:`TierGuard` runs a tier's reads (``contains``, ``read_into``) on daemon threads of its
  own and waits for each until it has made no progress for ``timeout`` seconds (a read of many
  chunks reports each chunk it finishes, :func:`progress`, so a long read that keeps moving is
  never cut; one that stalls is). Past that the read is *abandoned*: the caller gets a miss at
  once (:class:`TierTimeout`), and the thread finishes whenever the stalled call returns. Until
  then it holds shares of the read's host leases, so no buffer is reused under it; what it read
  is never used. At most ``max_stuck`` abandoned calls of one tier may still be running: beyond
  that the tier backs off (its reads are misses at once, without a thread), and only the trial
  call after each back-off may take one more thread, up to ``max_threads`` in all.
* :class:`Breaker`, the consecutive-failure circuit breaker every lower tier shares: after
  ``failures`` consecutive failures (here: calls past their deadline; the Redis tier also counts
  network failures with one of its own) the tier is skipped for ``cooldown`` seconds, with one
  log line, then one trial call decides whether it closes again (one log line when it does).

The threads are daemon threads: a read stuck for ever never holds up the interpreter's exit (a
``concurrent.futures`` pool would: its threads are joined at exit).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from lmcache.errors import TierTimeout, TierUnavailable

if TYPE_CHECKING:
    from lmcache.memory import MemoryLease

__all__ = ["Breaker", "TierGuard", "TierTimeout", "TierUnavailable", "progress"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Breaker:
    """Consecutive-failure circuit breaker: closed → open (cool-down) → one trial → closed.

    Thread-safe. Logs when it opens (once per opening) and when it closes again.

    Args:
        failures: Consecutive failures that open it (>= 1).
        cooldown: Seconds it stays open before one trial operation is let through.
        describe: Names what fails in messages (a masked URL, a folder).
        label: Prefix of its log lines (``"lmcache remote tier"``).
        failure: What a failure is, in its log lines (``"failures"``, ``"timeouts"``).
    """

    def __init__(
        self,
        failures: int,
        cooldown: float,
        describe: str,
        *,
        label: str = "lmcache tier",
        failure: str = "failures",
    ) -> None:
        self.failures = failures
        self.cooldown = cooldown
        self.describe = describe
        self.label = label
        self.failure = failure
        self._lock = threading.Lock()
        self._consecutive = 0
        self._open_until: float | None = None  # None: closed
        self._trial = False

    @property
    def is_open(self) -> bool:
        """Whether operations are being skipped (cooling down or trying)."""
        with self._lock:
            return self._open_until is not None

    def admit(self) -> bool:
        """Let an operation through; returns whether it is the trial of an open breaker.

        Raises:
            TierUnavailable: the breaker is open (cooling down, or a trial is running).
        """
        with self._lock:
            if self._open_until is None:
                return False
            left = self._open_until - time.monotonic()
            if left > 0 or self._trial:
                raise TierUnavailable(
                    f"{self.describe} is unavailable (circuit breaker open after repeated "
                    f"{self.failure}, next try in {max(left, 0.0):.1f} s)"
                )
            self._trial = True
            return True

    def trip(self, reason: str | None = None) -> None:
        """Open now (for ``cooldown`` s); logs ``reason`` unless it was open already (without a
        reason the caller logs)."""
        with self._lock:
            was_open = self._open_until is not None
            self._consecutive = max(self._consecutive, self.failures)
            self._open_until = time.monotonic() + self.cooldown
            self._trial = False
        if reason is not None and not was_open:
            logger.warning(
                "%s: %s: %s; operations are misses, retrying in %.1f s.",
                self.label,
                self.describe,
                reason,
                self.cooldown,
            )

    def record(self, outcome: bool | None, trial: bool, exc: BaseException | None = None) -> None:
        """Count an operation's outcome: ``True`` ok, ``False`` a failure, ``None`` neither."""
        with self._lock:
            if trial:
                self._trial = False
            if outcome is None:
                return
            if outcome:
                self._consecutive = 0
                if self._open_until is not None:
                    self._open_until = None
                    logger.warning("%s: %s answers again; closed again.", self.label, self.describe)
                return
            self._consecutive += 1
            if trial:
                self._open_until = time.monotonic() + self.cooldown
                logger.debug(
                    "%s: %s still failing (%r); retrying in %.1f s.",
                    self.label,
                    self.describe,
                    exc,
                    self.cooldown,
                )
            elif self._open_until is None and self._consecutive >= self.failures:
                self._open_until = time.monotonic() + self.cooldown
                logger.warning(
                    "%s: circuit breaker open after %d consecutive %s of %s (last: %r); "
                    "operations are misses, retrying in %.1f s.",
                    self.label,
                    self._consecutive,
                    self.failure,
                    self.describe,
                    exc,
                    self.cooldown,
                )


class _Job(Generic[_T]):
    """One guarded call. Its fields change under the guard's lock (``last``: by :func:`progress`
    on the job's thread, without it: a float store)."""

    __slots__ = (
        "abandoned",
        "done",
        "error",
        "finished",
        "fn",
        "holds",
        "last",
        "result",
        "started",
    )

    def __init__(self, fn: Callable[[], _T], holds: list[MemoryLease]) -> None:
        self.fn = fn
        self.holds = holds
        self.done = threading.Event()
        self.last = time.monotonic()
        self.started = False
        self.finished = False
        self.abandoned = False
        self.result: _T | None = None
        self.error: BaseException | None = None


_local = threading.local()


def progress() -> bool:
    """Report progress of the guarded call running on this thread (e.g. one more chunk read):
    its deadline starts again. Returns ``False`` when the call was abandoned already (the caller
    stops early: nobody uses its result); ``True`` outside a guarded call."""
    job: _Job[object] | None = getattr(_local, "job", None)
    if job is None:
        return True
    job.last = time.monotonic()
    return not job.abandoned


class TierGuard:
    """Runs one tier's calls on daemon threads, each under a progress deadline (module doc).

    Args:
        kind: The tier's kind (``"disk"``, ``"remote"``): names its threads and log lines.
        timeout: Seconds a call may go without progress before it is abandoned; ``None`` runs
            calls on the caller's thread without a deadline.
        max_stuck: Abandoned calls still running beyond which the tier backs off.
        max_threads: Threads of this guard at most (running, stuck or idle).
        failures: Consecutive abandoned calls that make the tier back off.
        cooldown: Seconds of each back-off before one trial call.
        idle_s: Seconds an idle thread waits for work before it exits.
        label: Prefix of its back-off's log lines (default ``"lmcache <kind> tier"``).

    Attributes:
        breaker: The back-off of this tier's calls (:class:`Breaker`, counting timeouts).
    """

    def __init__(
        self,
        kind: str,
        timeout: float | None,
        *,
        max_stuck: int = 4,
        max_threads: int = 16,
        failures: int = 3,
        cooldown: float = 30.0,
        idle_s: float = 30.0,
        label: str | None = None,
    ) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"TierGuard timeout is {timeout!r}; expected seconds > 0, or None")
        if not 1 <= max_stuck < max_threads:
            raise ValueError(
                f"TierGuard max_stuck={max_stuck}, max_threads={max_threads}: expected "
                "1 <= max_stuck < max_threads"
            )
        self.kind = kind
        self.timeout = timeout
        self.max_stuck = max_stuck
        self.max_threads = max_threads
        self.breaker = Breaker(
            failures,
            cooldown,
            kind,
            label=label if label is not None else f"lmcache {kind} tier",
            failure="timeouts",
        )
        self._idle_s = idle_s
        self._cond = threading.Condition()
        self._queue: deque[_Job[object]] = deque()
        self._threads = 0
        self._idle = 0
        self._stuck = 0
        self._closed = False

    @property
    def stuck(self) -> int:
        """Abandoned calls whose thread is still running."""
        with self._cond:
            return self._stuck

    @property
    def threads(self) -> int:
        """Threads of this guard alive now."""
        with self._cond:
            return self._threads

    def call(self, fn: Callable[[], _T], holds: Sequence[MemoryLease] = ()) -> _T:
        """``fn()`` on a guard thread, waited for until it goes ``timeout`` s without progress.

        Args:
            fn: The tier call; it may call :func:`progress` as it goes.
            holds: Leases of the buffers ``fn`` writes: a share of each is held until ``fn``
                returns, even when the call is abandoned, so they are never reused under it.

        Returns:
            What ``fn`` returned.

        Raises:
            TierUnavailable: the tier is backing off (nothing was run).
            TierTimeout: the call was abandoned (it may still be running).
            Exception: what ``fn`` raised.
        """
        if self.timeout is None:
            return fn()
        with self._cond:
            closed = self._closed
        if closed:  # a closed tier is not used by engines; keep old callers working
            return fn()
        trial = self.breaker.admit()
        shares: list[MemoryLease] = []
        try:
            for lease in holds:
                shares.append(lease.share())
        except BaseException:
            _release(shares)
            self.breaker.record(None, trial)
            raise
        job: _Job[_T] = _Job(fn, shares)
        try:
            with self._cond:
                if self._stuck >= (self.max_threads - 1 if trial else self.max_stuck):
                    stuck = self._stuck
                    raise TierUnavailable(f"{stuck} calls are stuck past their deadline")
                if self._idle <= len(self._queue) and self._threads < self.max_threads:
                    threading.Thread(
                        target=self._work, name=f"lmcache-{self.kind}-read", daemon=True
                    ).start()  # it waits for the lock: counted before it can exit
                    self._threads += 1
                self._queue.append(job)  # type: ignore[arg-type]
                self._cond.notify()
        except BaseException as exc:  # nothing was queued
            _release(job.holds)
            self.breaker.record(None, trial)
            if isinstance(exc, TierUnavailable):
                self.breaker.trip(f"{exc}; backing off")
            raise
        while not job.done.wait(max(job.last + self.timeout - time.monotonic(), 0.0)):
            if time.monotonic() - job.last < self.timeout:
                continue  # it progressed meanwhile
            with self._cond:
                if job.finished:
                    break
                job.abandoned = True
                if job.started:
                    self._stuck += 1
            late = TierTimeout(
                f"{self.breaker.label} call made no progress within {self.timeout:g} s; abandoned"
            )
            self.breaker.record(False, trial, late)
            raise late
        self.breaker.record(True, trial)
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def _work(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                self._cond.wait_for(lambda: self._queue or self._closed, self._idle_s)
                self._idle -= 1
                if not self._queue:  # idle too long, or closed
                    self._threads -= 1
                    return
                job = self._queue.popleft()
                if job.abandoned:  # given up before it started
                    _release(job.holds)
                    continue
                job.started = True
            _local.job = job
            try:
                job.result = job.fn()
            except BaseException as exc:
                job.error = exc
            finally:
                _local.job = None
                with self._cond:
                    job.finished = True
                    if job.abandoned:
                        self._stuck -= 1
                _release(job.holds)
                job.done.set()

    def close(self) -> None:
        """Let idle threads exit; later calls run on the caller's thread. Stuck calls keep their
        (daemon) threads until they return."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _release(leases: list[MemoryLease]) -> None:
    for lease in leases:
        lease.release()
    leases.clear()
