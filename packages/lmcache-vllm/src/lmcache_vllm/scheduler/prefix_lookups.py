# SPDX-License-Identifier: Apache-2.0
"""The scheduler's lookups of how many leading prompt tokens the worker ranks hold.

A lookup runs on the scheduler's thread when only host memory can answer it.
With a disk or remote tier it may take longer than a scheduler step, so it runs on a thread
pool of its own under a deadline. So does a lookup on CUDA with checksums, which waits for the
GPU's check of the hit.
vLLM then hears "ask again later" (``None``) until the answer is in, unless it comes within
:data:`QUICK_ANSWER_S` (a miss, mostly): a request that nothing can load is scheduled at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from lmcache.config import LMCacheConfig
from lmcache_vllm.lookup_wire import LookupQuery
from lmcache_vllm.scheduler.lookup_client import LookupClient

__all__ = [
    "ASYNC_LOOKUP_TIMEOUT_S",
    "LATE_GRACE_S",
    "LOOKUP_THREADS",
    "QUICK_ANSWER_S",
    "SEVERAL_NODES",
    "PrefixLookups",
    "runs_off_thread",
]

SEVERAL_NODES = (
    "lmcache: this engine's %d worker ranks span several nodes (%d on this node); lookups reach "
    "only this node's ranks, so lmcache loads nothing for this engine (every prompt is computed) "
    "and only stores. Run each engine within one node to get hits."
)
"""Logged once at start-up by an engine whose ranks span nodes (``%d``: ranks, on this node)."""

ASYNC_LOOKUP_TIMEOUT_S = 30.0
"""Deadline of one asynchronous lookup (disk / remote tiers): it runs off the scheduler thread,
so it may read a long prompt's chunks from a slow disk or network; a rank that misses it is a
miss. A hung tier costs less: each of its reads is abandoned after ``tier_timeout`` seconds
without progress."""

LOOKUP_THREADS = 4
"""Asynchronous lookups that may run at once (each on its own thread)."""

QUICK_ANSWER_S = 0.001
"""How long the scheduler waits for an asynchronous lookup before answering "ask again later".
A miss answers within it (a host-memory lookup takes well under a millisecond), so a new prompt
is not held back a step; a hit checked on the GPU takes longer (its copy to the device)."""

LATE_GRACE_S = 1.0
"""An asynchronous lookup still pending this long after its deadline (it waited for a thread)
is a miss."""


def runs_off_thread(device_type: object, config: LMCacheConfig) -> bool:
    """Whether lookups run on the pool, off the scheduler's thread.

    They do with a disk or remote tier, which may be slow. They do on CUDA with checksums too:
    the worker checks a hit on the GPU before it answers, which waits for the hit's copy.
    """
    if config.local_disk is not None or config.remote_url is not None:
        return True
    return str(device_type) == "cuda" and config.checksum is not False


class PrefixLookups:
    """One scheduler's lookups, and the asynchronous ones still in flight.

    Args:
        engine_key: Names the engine whose worker ranks answer.
        world_size: Worker ranks to ask.
        asynchronous: Run lookups on a thread pool under :data:`ASYNC_LOOKUP_TIMEOUT_S`.

    Attributes:
        client: The lookup client, built at the first lookup (tests put a fake one here).
        pending: Asynchronous lookups in flight by request id, each with the time past which
            it is a miss.
        late: Asynchronous lookups that became a miss past that time, since construction.
    """

    def __init__(self, engine_key: str, world_size: int, asynchronous: bool) -> None:
        self.engine_key = engine_key
        self.world_size = world_size
        self.asynchronous = asynchronous
        self.client: LookupClient | None = None
        self.pending: dict[str, tuple[Future[int], float]] = {}
        self.late = 0
        self._pool: ThreadPoolExecutor | None = None

    def get_client(self) -> LookupClient:
        """The lookup client, built on first use."""
        if self.client is None:
            self.client = LookupClient(
                self.engine_key,
                self.world_size,
                timeout_s=ASYNC_LOOKUP_TIMEOUT_S if self.asynchronous else 1.0,
                direct_deadline=self.asynchronous,  # a worker here may be stuck on a tier
            )
        return self.client

    def ask(self, rid: str, query: Callable[[], LookupQuery]) -> int | None:
        """Leading tokens every rank holds for request ``rid``; ``None`` while in flight.

        ``query`` builds the question only when one is sent.
        An asynchronous lookup answered within :data:`QUICK_ANSWER_S` is returned at once.
        One past its deadline is a miss (0), counted in :attr:`late`.
        Its worker-side lease, if one comes, goes with the request's end (or its load-less
        first step).
        """
        pending = self.pending.pop(rid, None)
        if pending is not None and not pending[0].done():
            if time.monotonic() <= pending[1]:
                self.pending[rid] = pending
                return None  # vLLM asks again at a later step
            self.late += 1  # e.g. queued behind stuck lookups
            return 0
        if pending is not None:
            return pending[0].result()  # LookupClient.lookup never raises
        if self.asynchronous:
            client = self.get_client()
            future = self._threads().submit(client.lookup, query())
            try:  # a miss is answered now: the request is not held back a step
                return future.result(timeout=QUICK_ANSWER_S)
            except TimeoutError:
                pass
            late = getattr(client, "timeout_s", ASYNC_LOOKUP_TIMEOUT_S) + LATE_GRACE_S
            self.pending[rid] = (future, time.monotonic() + late)
            return None
        return self.get_client().lookup(query())

    def forget(self, rid: str) -> None:
        """Drop ``rid``'s answer still in flight, unread, and what the client sent for it."""
        self.pending.pop(rid, None)
        forget = getattr(self.client, "forget", None)  # tests may put a fake client here
        if forget is not None:
            forget(rid)

    def _threads(self) -> ThreadPoolExecutor:
        """Threads of asynchronous lookups (each call returns by its deadline: none is held)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="lmcache-lookup")
        return self._pool

    def close(self) -> None:
        """Close the lookup connections (idempotent)."""
        self.pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self.client is not None:
            self.client.close()
            self.client = None
