# SPDX-License-Identifier: Apache-2.0
"""Chunks leased at lookup time, held per request until its load (or its end).

When the scheduler reports N matched tokens to vLLM, the chunks behind them must still be there
when the worker loads them: vLLM's ``kv_load_failure_policy="recompute"`` is unreliable on some
model runners, so a promised load must not fail in normal operation. Each worker rank's lookup
therefore takes verified leases on the chunks it found (:meth:`LMCacheEngine.lookup_and_lease`)
and parks them here under the request id: a leased chunk is never evicted, and its checksum was
checked once, at lookup. The load uses them and releases them; so do the request's end, a
newer lookup of the same request, and a timeout for requests that vanished (counted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from lmcache.held_hit import HeldHit

__all__ = ["HeldHits"]

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    hit: HeldHit
    num_query_tokens: int
    salt: str
    expires: float


class HeldHits:
    """Leased lookup hits by request id (thread-safe: the lookup server thread puts, the
    worker's step pops).

    Args:
        timeout_s: A hit not taken within this many seconds of its last lookup is released.
    """

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self.expired = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def reuse(self, req_id: str, num_query_tokens: int, salt: str) -> int | None:
        """The held hit's token count when ``req_id`` already holds one for the same query
        (vLLM asks again while a request waits), refreshing its timeout; else ``None``."""
        with self._lock:
            held = self._held.get(req_id)
            if held is None or held.num_query_tokens != num_query_tokens or held.salt != salt:
                return None
            held.expires = time.monotonic() + self.timeout_s
            return held.hit.num_tokens

    def put(self, req_id: str, hit: HeldHit, num_query_tokens: int, salt: str) -> None:
        """Hold ``hit`` for ``req_id``, releasing what it held before (an empty hit is released
        at once)."""
        new = None
        if hit.num_tokens > 0:
            new = _Held(hit, num_query_tokens, salt, time.monotonic() + self.timeout_s)
        else:
            hit.release()
        with self._lock:
            old = self._held.pop(req_id, None)
            if new is not None:
                self._held[req_id] = new
        if old is not None:
            old.hit.release()

    def pop(self, req_id: str) -> HeldHit | None:
        """Take the hit held for ``req_id`` (the caller releases it)."""
        with self._lock:
            held = self._held.pop(req_id, None)
        return None if held is None else held.hit

    def release(self, req_ids: Iterable[str]) -> None:
        """Release the hits of ``req_ids`` (those that hold one)."""
        for req_id in req_ids:
            hit = self.pop(req_id)
            if hit is not None:
                hit.release()

    def expire(self, now: float | None = None) -> int:
        """Release hits past their timeout; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [r for r, h in self._held.items() if h.expires <= now]
            hits = [self._held.pop(r).hit for r in gone]
        for hit in hits:
            hit.release()
        if hits:
            self.expired += len(hits)
            logger.info(
                "lmcache: released the leased chunks of %d request(s) not loaded within %.0f s "
                "of their lookup",
                len(hits),
                self.timeout_s,
            )
        return len(hits)

    def clear(self) -> None:
        """Release everything."""
        with self._lock:
            hits = [h.hit for h in self._held.values()]
            self._held.clear()
        for hit in hits:
            hit.release()
