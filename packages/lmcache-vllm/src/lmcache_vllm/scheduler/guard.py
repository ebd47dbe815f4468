# SPDX-License-Identifier: Apache-2.0
"""Scheduler hooks that never raise into vLLM: each failure is a miss, counted and logged once.

:class:`GuardedHooks` is the base of :class:`~lmcache_vllm.scheduler.side.SchedulerSide`.
vLLM calls the scheduler side from its scheduler loop, where an exception would stop the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

__all__ = ["GuardedHooks"]

logger = logging.getLogger("lmcache_vllm.scheduler.side")

_T = TypeVar("_T")


class GuardedHooks:
    """Runs hook bodies under :meth:`_guard` and counts ``scheduler_failures`` in :attr:`stats`."""

    def __init__(self) -> None:
        self._failures_logged: set[tuple[str, str]] = set()
        self.stats = {"scheduler_failures": 0, "skipped_requests": 0, "lookup_timeouts": 0}

    def _on_failure(self, request_id: str) -> None:
        """Forget what the failed request had armed (a subclass's state)."""

    def _guard(self, where: str, request_id: str, default: _T, fn: Callable[[], _T]) -> _T:
        """Run ``fn``; on any exception :meth:`_failed` and return ``default``."""
        try:
            return fn()
        except Exception as exc:
            self._failed(where, request_id, exc)
            return default

    def _failed(self, where: str, request_id: str, exc: Exception) -> None:
        """Count a failure, log it once per (where, type), forget the request's load."""
        self.stats["scheduler_failures"] += 1
        self._on_failure(request_id)
        kind = (where, type(exc).__name__)
        if kind in self._failures_logged:
            return
        self._failures_logged.add(kind)
        logger.warning(
            "lmcache: %s failed for request %s (%r); treating it as a miss. Further %s errors "
            "in %s are counted, not logged.",
            where,
            request_id,
            exc,
            kind[1],
            where,
            exc_info=exc,
        )
