# SPDX-License-Identifier: Apache-2.0
"""The worker's loads: each request's leased hit into vLLM's pages, and what it delivered.

vLLM's forward thread runs them at ``start_load_kv``.
On the CPU a load is one synchronous retrieve.
On CUDA, and layerwise, a load only starts a layerwise retrieve, which
:mod:`lmcache_vllm.worker.layerwise_step` drives.
Tokens that did not arrive make their blocks load errors. vLLM hears of them after the step:
per block with one KV cache group, per request with asynchronous loads
(:mod:`lmcache_vllm.worker.async_loads`). It recomputes or fails the request, as its
``kv_load_failure_policy`` says. Each failure is also noted
(:mod:`~lmcache_vllm.worker.failed_loads`), so that no save stores KV computed over the unfilled
blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, ReqMeta
from lmcache_vllm.transfer.transfer_plan import LoadOutcome, load_outcome, load_plan
from lmcache_vllm.worker.counters import WorkerCounters
from lmcache_vllm.worker.failed_loads import FailedLoads
from lmcache_vllm.worker.hit_prefetch import HitPrefetcher
from lmcache_vllm.worker.lookup_leases import LookedUp, LookupLeases

if TYPE_CHECKING:
    from lmcache.cache_engine import HeldHit, LayerwiseRetrieve

__all__ = ["RequestLoads"]

logger = logging.getLogger(__name__)


class RequestLoads:
    """Loads of one worker, and the blocks whose load failed since vLLM last asked.

    Args:
        chunk_size: lmcache's chunk size in tokens.
        block_size: vLLM's block size in tokens.
        layerwise: lmcache runs layerwise.
        load_lock: Held while a synchronous load copies (saves have their own).
        counters: Where loads are counted.
        prefetcher: Copies a hit to the device ahead of a layerwise load.
    """

    def __init__(
        self,
        chunk_size: int,
        block_size: int,
        layerwise: bool,
        load_lock: threading.Lock,
        counters: WorkerCounters,
        prefetcher: HitPrefetcher,
    ) -> None:
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.layerwise = layerwise
        self.asynchronous = False  # CUDA: batched loads are enqueued, not waited for
        self.errors: set[int] = set()
        self.failed = FailedLoads(block_size, chunk_size)  # what the saves may not store
        self._load_lock = load_lock
        self._counters = counters
        self._prefetcher = prefetcher

    @property
    def synchronous(self) -> bool:
        """Every load is over when :meth:`load` returns (batched, on the CPU)."""
        return not (self.layerwise or self.asynchronous)

    def load_all(
        self,
        meta: LMCacheConnectorMetadata | None,
        engine: LMCacheEngine | None,
        leases: LookupLeases,
    ) -> list[tuple[ReqMeta, LayerwiseRetrieve, HeldHit | None]]:
        """Load every request of ``meta`` that loads (each takes its lease; the others' leases
        go); returns the layerwise retrieves left to drive."""
        layerwise: list[tuple[ReqMeta, LayerwiseRetrieve, HeldHit | None]] = []
        if meta is None or engine is None:
            return layerwise
        for req in meta.requests:
            held, looked = leases.take(req.req_id)
            if req.load is None:
                if held is not None:
                    held.release()
                continue
            started = self.load(engine, req, held, looked)
            if started is not None:
                layerwise.append((req, started, held))
        return layerwise

    def take_errors(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        errors, self.errors = self.errors, set()
        return errors

    def record(self, req: ReqMeta, loaded: torch.Tensor | None) -> None:
        """Count what ``req``'s load delivered (``loaded``: a mask over its tokens, or
        ``None`` for nothing); blocks from the first missing token on become load errors."""
        outcome = load_outcome(req, loaded, self.block_size)
        with self._counters.lock:
            self._counters.stats.expected_load_tokens += outcome.expected
            self._counters.stats.loaded_tokens += outcome.loaded
            self._counters.stats.failed_load_tokens += outcome.failed
            self._counters.stats.num_loads += 1
        if outcome.bad_blocks:
            self._failed(req, outcome)
            logger.warning(
                "lmcache: request %s loaded %d of %d tokens; blocks %s did not load (vLLM "
                "recomputes or fails the request, as kv_load_failure_policy says)",
                req.req_id,
                outcome.loaded,
                outcome.expected,
                outcome.bad_blocks,
            )

    def _failed(self, req: ReqMeta, outcome: LoadOutcome) -> None:
        """The blocks of ``req`` from its first token not loaded on are load errors, and no
        save stores KV computed over them."""
        assert req.load is not None  # load_outcome() needs it
        if not outcome.bad_blocks:
            return  # what failed lies past what vLLM was promised: it computes that anyway
        self.errors.update(outcome.bad_blocks)
        self.failed.failed(req, req.load.load_end - outcome.failed, outcome.bad_blocks)

    def load(
        self,
        engine: LMCacheEngine,
        req: ReqMeta,
        held: HeldHit | None,
        looked: LookedUp | None = None,
    ) -> LayerwiseRetrieve | None:
        """Load ``req`` (batched), or return its layerwise retrieve for the caller to drive;
        the keys its lookup computed (``looked``) are reused where they match its tokens."""
        plan = load_plan(req, self.block_size, self.chunk_size)
        if plan is None:
            if held is not None:
                held.release()
            self.record(req, None)
            return None
        tokens, mask, transfer, _ = plan
        if held is not None and self.layerwise:
            # not copied at lookup (past the budget): copy per layer group now
            self._prefetcher.prefetch(engine, held)
        if held is not None and held.prefetched is not None:
            transfer = dataclasses.replace(transfer, staged=held.prefetched)
        extra = req.extra_keys or None
        known: list[bytes] = []
        if held is not None and looked is not None:
            known = looked.keys_for(held, tokens, req.salt, extra, self.chunk_size)
        started = time.perf_counter()
        loaded: torch.Tensor | None = None
        try:
            if self.layerwise or self.asynchronous:
                retriever = engine.retrieve_layerwise(
                    tokens,
                    mask,
                    transfer,
                    salt=req.salt,
                    extra_keys=extra,
                    held=held,
                    known_keys=known,
                )
                full = torch.zeros(len(req.token_ids), dtype=torch.bool)
                assert req.load is not None  # load_plan returned a plan
                lo = req.load.vllm_cached // self.chunk_size * self.chunk_size
                full[lo : lo + retriever.num_hit_tokens] = True
                self.record(req, full)
                return retriever
            with self._load_lock:
                loaded = engine.retrieve(
                    tokens,
                    mask,
                    transfer,
                    salt=req.salt,
                    extra_keys=extra,
                    held=held,
                    known_keys=known,
                )
        except Exception:
            logger.exception("lmcache: load of request %s failed", req.req_id)
        if held is not None:
            held.release()
        with self._counters.lock:
            self._counters.stats.load_seconds += time.perf_counter() - started
        self.record(req, loaded)
        return None

    def chunks_rejected(self, req: ReqMeta, loaded: torch.Tensor, lost: int) -> None:
        """Chunks of an enqueued load failed their checksum on the device: their blocks (and
        the rest of the load) become load errors, so vLLM recomputes them."""
        outcome = load_outcome(req, loaded, self.block_size)
        with self._counters.lock:
            self._counters.stats.loaded_tokens -= lost
            self._counters.stats.failed_load_tokens += lost
        self._failed(req, outcome)
        logger.warning(
            "lmcache: request %s: %d loaded tokens failed their checksum; blocks %s did not "
            "load (vLLM recomputes or fails the request, as kv_load_failure_policy says)",
            req.req_id,
            lost,
            outcome.bad_blocks,
        )

    def fail_whole(self, req: ReqMeta) -> None:
        """Every block of ``req``'s load becomes a load error (an enqueued load failed)."""
        load = req.load
        if load is not None:
            first, end = load.vllm_cached // self.block_size, -(-load.load_end // self.block_size)
            self.errors.update(req.block_ids[first:end])
            self.failed.failed(req, load.vllm_cached, req.block_ids[first:end])
