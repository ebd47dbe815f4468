# SPDX-License-Identifier: Apache-2.0
"""``--enable-lmcache`` stores on SGLang 0.5.17-0.5.19, kept off the request's answer.

``LMCRadixCache`` calls ``store_kv`` when a request finishes, before SGLang sends the answer.
SGLang may reuse the request's pages as soon as the call returns. On a device with streams a
store here therefore runs in four steps:

1. the request's slots are read to the host on a small stream of ours, and a copy stream of
   ours waits for the caller's stream (the forward wrote the KV);
2. on the copy stream, the chunks' KV is gathered out of SGLang's pools and its copy to pinned
   host buffers is enqueued;
3. the caller's stream waits for the gather only; SGLang orders every later forward (and every
   load) after its scheduler's stream, so no page is rewritten before the gather read it;
4. the call returns; a commit thread waits for the host copy and publishes the chunks.

The answer no longer waits for the copy, its checksums or the publication. A lookup whose first
chunk matches a store still in flight waits for that store, so a prompt is a hit as soon as its
request has finished. Without streams (the CPU) a store is synchronous, as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.devices import get_backend
from lmcache.engine.store_plan import StagedStore
from lmcache.gpu_connector.interface import TransferSpec

__all__ = ["DeferredStores"]

logger = logging.getLogger(__name__)


class DeferredStores:
    """The stores of one ``--enable-lmcache`` connector (see the module docstring).

    Args:
        engine: lmcache's cache engine of the connector.
        device: The device of SGLang's KV pools.
        chunk_size: Tokens per chunk (a lookup waits for stores that share its first chunk).
    """

    def __init__(self, engine: LMCacheEngine, device: torch.device, chunk_size: int) -> None:
        self._engine = engine
        self._device = device
        self._chunk = int(chunk_size)
        self._backend = get_backend(device)
        streams = self._backend.has_streams
        self._stream = self._backend.new_stream(device) if streams else None
        self._index_stream = self._backend.new_stream(device) if streams else None
        self._commits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-sgl-commit")
        self._lock = threading.Lock()
        self._in_flight: dict[Future[int], tuple[int, ...]] = {}

    def store(self, tokens: list[int], slots: torch.Tensor) -> int:
        """Store ``tokens`` (their KV at ``slots``); returns the tokens it will publish.

        Raises:
            Errors of the copy, as :meth:`LMCacheEngine.store` raises them (nothing is kept).
        """
        backend, stream = self._backend, self._stream
        caller = backend.current_stream(self._device)
        if stream is None or self._index_stream is None:
            return self._engine.store(tokens, None, TransferSpec(slots.to(torch.int64)))
        # The slots were written before the forward that finished the request, which has
        # completed: read them on a stream of their own. On the caller's stream the read waits
        # for the forward SGLang queued since (tens of ms); on ours, for the last host copy.
        with backend.use_stream(self._index_stream):
            slots = slots.to("cpu", torch.int64)
        backend.wait_event(stream, backend.event_after(caller))  # the forward wrote the KV
        read: list[Any] = []

        def _read() -> None:  # the gather is enqueued: later work may rewrite the pages after it
            read.append(backend.event_after(stream))

        with backend.use_stream(stream):
            spec = TransferSpec(slots, stream=stream, deferred=True, on_engine_read=_read)
            staged = self._engine.copy_out(tokens, None, spec)
            copied = backend.event_after(stream, blocking=True)
        backend.wait_event(caller, read[0] if read else copied)
        planned = staged.num_tokens
        if planned == 0:  # every chunk was stored already
            staged.commit()
            return 0
        future = self._commits.submit(self.commit, staged, copied)
        with self._lock:
            self._in_flight[future] = tuple(tokens[: self._chunk])
        future.add_done_callback(self._forget)
        return planned

    def commit(self, staged: StagedStore, copied: Any) -> int:
        """Commit thread: wait for the host copy, then publish the chunks."""
        try:
            self._backend.event_synchronize(copied)
        except BaseException:
            staged.abort()
            raise
        return staged.commit()

    def _forget(self, future: Future[int]) -> None:
        with self._lock:
            self._in_flight.pop(future, None)
        exc = future.exception()
        if exc is not None:
            logger.warning("lmcache store failed (%r); skipped.", exc)

    def wait_for(self, tokens: Sequence[int]) -> None:
        """Wait for the stores in flight whose first chunk is ``tokens``' (or a prefix of it)."""
        with self._lock:
            if not self._in_flight:
                return
            waits = [
                f for f, first in self._in_flight.items() if tuple(tokens[: len(first)]) == first
            ]
        for future in waits:
            with contextlib.suppress(Exception):  # logged by _forget: the lookup finds the rest
                future.result()

    def close(self) -> None:
        """Publish the stores in flight, then stop the commit thread."""
        self._commits.shutdown(wait=True)
