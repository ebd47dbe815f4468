# SPDX-License-Identifier: Apache-2.0
"""Device work on a leased hit between its lookup and its load (CUDA caches only).

It runs on the lookup server's threads, when a lookup leases a hit.
:meth:`HitPrefetcher.prefetch` starts copying the hit to the device on the copy stream.
The load at the step's start then only scatters it into vLLM's pages.
:meth:`HitPrefetcher.verify` checks the hit's checksums on the device and cuts it before the
first bad chunk.
"""

from __future__ import annotations

import logging
import threading
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.gpu_connector import ChunkTransfer, TransferSpec
from lmcache_vllm.transfer.fused.plan import Prefetched
from lmcache_vllm.transfer.paged_connector import VLLMPagedConnector
from lmcache_vllm.worker.layerwise_step import layer_groups

if TYPE_CHECKING:
    from lmcache.cache_engine import HeldHit

__all__ = ["HitPrefetcher"]

logger = logging.getLogger(__name__)


class HitPrefetcher:
    """Copies hits to the device ahead of their load, within a memory budget, and verifies them.

    Args:
        chunk_size: lmcache's chunk size in tokens.
        layerwise: Copy in the layerwise load's layer groups.
    """

    budget_bytes: int = 2 << 30
    """Device memory that hits copied ahead of their load may hold at once."""

    def __init__(self, chunk_size: int, layerwise: bool) -> None:
        self.chunk_size = chunk_size
        self.layerwise = layerwise
        self.in_flight_bytes = 0  # device copies of hits made ahead of their load
        self._lock = threading.Lock()
        self._copy_stream: Any = None

    def attach(self, copy_stream: Any) -> None:
        """Copy and verify on ``copy_stream``; ``None`` (no device streams) turns both off."""
        self._copy_stream = copy_stream

    def verify(self, engine: LMCacheEngine, hit: HeldHit) -> None:
        """Check the hit's chunks against their stored checksums on the device now.

        The check reads the prefetch's device copy, else goes through a scratch buffer.
        The hit is cut before the first bad chunk.
        vLLM is then promised only verified tokens: a bad chunk is a miss, not a load error.
        vLLM's default ``kv_load_failure_policy`` would turn a load error into a failed request.
        A check of the prefetch's copy stays with it: the load scatters those bytes unchecked.
        A hit checked through the scratch buffer crosses PCIe again at its load, and is
        verified again there, as its bytes are new.
        """
        connector = engine.gpu_connector
        if (
            hit.num_tokens <= 0
            or self._copy_stream is None
            or not isinstance(connector, VLLMPagedConnector)
            or not connector.verifies_checksums
        ):
            return
        chunks = self._chunks(hit)
        if all(c.checksum is None for c in chunks):
            return
        pre = hit.prefetched if isinstance(hit.prefetched, Prefetched) else None
        try:
            ok = connector.verify_chunks(chunks, self._copy_stream, pre)
        except Exception as exc:  # the load verifies again: a failure here only costs time
            logger.warning("lmcache: could not verify a hit at lookup (%s)", exc)
            return
        if ok is not None:
            engine.cut_held_hit(hit, ok)

    def _chunks(self, hit: HeldHit) -> list[ChunkTransfer]:
        """The hit's chunks (token ranges from 0, host buffers, stored sums), in chain order."""
        size = self.chunk_size
        return [
            ChunkTransfer(i * size, min((i + 1) * size, hit.num_tokens), t, checksum=s)
            for i, (t, s) in enumerate(zip(hit.tensors(), hit.checksums(), strict=True))
        ]

    def prefetch(self, engine: LMCacheEngine, hit: HeldHit) -> None:
        """Start copying a fresh hit to the device now, on the copy stream.

        The copy overlaps vLLM's scheduling and input preparation.
        Layerwise, the copy goes in the load's layer groups, each scattered as soon as its own
        copy is in.
        A hit that would pass :attr:`budget_bytes` is not copied.
        This never fails a lookup.
        """
        connector = engine.gpu_connector
        if (
            self._copy_stream is None
            or hit.num_tokens <= 0
            or hit.prefetched is not None
            or not isinstance(connector, VLLMPagedConnector)
        ):
            return
        nbytes = connector.chunk_nbytes(hit.num_tokens)
        with self._lock:
            if self.in_flight_bytes + nbytes > self.budget_bytes:
                return
            self.in_flight_bytes += nbytes
        try:
            chunks = self._chunks(hit)
            connector.check_chunks(
                chunks, TransferSpec(torch.empty(hit.num_tokens, dtype=torch.long))
            )
            groups = layer_groups(connector.num_layers) if self.layerwise else ()
            done = connector.prefetch(chunks, self._copy_stream, groups)
        except Exception as exc:  # a device copy ahead of time is an optimisation only
            logger.debug("lmcache: no prefetch of a hit (%s)", exc)
            done = None
        if done is None:
            self._freed(nbytes)
            return
        weakref.finalize(done.staging, self._freed, nbytes)
        hit.prefetched = done
        # the copy reads the leased host buffers: the hit hands them back only once it is done,
        # even when no load takes the copy (the request ended, or was cut at verification)
        hit.copy_done = partial(connector.backend.event_synchronize, done.event)

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.in_flight_bytes -= nbytes
