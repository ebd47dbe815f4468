# SPDX-License-Identifier: Apache-2.0
"""Tiers below the CPU one (local disk, Redis/Valkey): the shared contract and write queue.

A :class:`LowerTier` stores chunks as :mod:`lmcache.tiers.chunk_format` entries (header +
raw bytes) under ``(fingerprint digest, chunk key)``. Its public methods never raise on a tier
fault (only a caller's malformed arguments are a ``ValueError``): a tier that fails, times out or holds a bad entry is a miss, counted in the caller's metrics
(``tier_errors``, ``checksum_failures``), and a bad entry is deleted. Subclasses implement the
``_exists`` / ``_read_into`` / ``_write`` / ``_delete`` / ``_clear`` primitives, which may
raise.

Writes are asynchronous: :meth:`LowerTier.submit_write` (one chunk) and
:meth:`LowerTier.submit_chain` (a run of one key chain, admitted head first) take a share of each
chunk's host lease and queue it for one writer thread
(:mod:`lmcache.tiers.write_queue`); when the queue holds
``write_queue_bytes`` already the write is dropped and counted (``dropped_writes``), never
blocking the caller. The lease is released
once the bytes are written (or dropped), so the host buffer cannot be reused under the write.

Eviction order. Chunk ``i``'s key hashes chunks ``0..i`` and a lookup stops at its first missing
chunk, so a chunk whose parent (the previous chunk) is gone is worthless. How a tier keeps
prefixes usable depends on who chooses its victims (:attr:`LowerTier.chooses_victims`):

- A tier that chooses them (the disk tier: its byte quota) records each chunk's parent (in the
  header, chunk format version 2), evicts orphans first and a chain's tail before its head
  (:class:`~lmcache.tiers.prefix_lru.PrefixLRU`), and declines a chunk that would fit only by
  evicting the prefix it extends (``_write`` returns ``False``, counted in ``dropped_writes``).
  Its runs are written head first (a chunk after a declined or failed one is dropped: it would
  be an orphan), then :meth:`LowerTier._chain_written` marks the run used tail first, so its
  head ends up the most recent.
- A tier whose server chooses them (Redis: its ``maxmemory-policy``) gets each run tail first,
  so the head is the most recently written key; nothing else is in lmcache's hands there.

Reads have a deadline: :meth:`LowerTier.contains`, :meth:`LowerTier.read_into` (and
:meth:`LowerTier.clear`) run their primitive on the tier's :class:`~lmcache.tiers.tier_guard.TierGuard` threads and give up once it
has made no progress for ``tier_timeout`` seconds (a hung mount, a server that accepts and never
answers): the read is a miss for that request, abandoned (its thread finishes whenever the
primitive returns, holding shares of the read's leases until then) and counted
(``tier_timeouts``); after repeated timeouts the tier backs off (misses at once, one log line),
then probes again. Subclasses call :func:`~lmcache.tiers.tier_guard.progress` after each chunk.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from lmcache.errors import CorruptChunk, TierTimeout, TierUnavailable
from lmcache.tiers.chunk_format import ChunkHeader
from lmcache.tiers.tier_guard import TierGuard
from lmcache.tiers.write_queue import QueuedWrite, WriteQueue

if TYPE_CHECKING:
    from lmcache.memory import MemoryLease
    from lmcache.metrics import LMCacheMetrics

__all__ = ["LowerTier", "ReadRequest"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadRequest:
    """One chunk to read: its key and the host buffer to read its payload into.

    Attributes:
        key: The 16-byte chunk key.
        out: A contiguous CPU tensor ``[num_layers, num_tokens, kv_width]`` of the chunk's dtype;
            its shape and dtype are what the entry must hold.
        lease: The host lease ``out`` belongs to, if any: a read abandoned past its deadline
            holds a share of it until the read returns, so the buffer is not reused under it.
            Without one, an abandoned read may still write ``out`` later.
    """

    key: bytes
    out: torch.Tensor
    lease: MemoryLease | None = None


class LowerTier(ABC):
    """A chunk store below the CPU tier. Thread-safe; public methods never raise on a tier fault.

    Args:
        write_queue_bytes: Bytes of queued writes beyond which new writes are dropped (one write
            is always admitted into an empty queue).
        tier_timeout: Seconds a read (``contains``, ``read_into``) may go without progress
            before it is abandoned as a miss (``config.tier_timeout``); ``None`` reads on the
            caller's thread without a deadline.
        max_stuck: Abandoned reads still running beyond which the tier backs off.
        backoff_failures: Consecutive abandoned reads that make the tier back off.
        backoff_s: Seconds of each back-off, before one trial read.
    """

    #: ``"disk"`` or ``"remote"``: names this tier's metrics (``disk_hit_chunks``, ...) and logs.
    kind: ClassVar[str]
    #: Whether lmcache chooses this tier's victims (see the module docstring): then chains are
    #: written head first with their parents, and :meth:`_chain_written` reorders them.
    chooses_victims: ClassVar[bool] = False

    def __init__(
        self,
        *,
        write_queue_bytes: int = 1 << 30,
        tier_timeout: float | None = 5.0,
        max_stuck: int = 4,
        backoff_failures: int = 3,
        backoff_s: float = 30.0,
    ) -> None:
        self._guard = TierGuard(
            self.kind,
            tier_timeout,
            max_stuck=max_stuck,
            failures=backoff_failures,
            cooldown=backoff_s,
        )
        self._writes = WriteQueue(
            write_queue_bytes,
            f"lmcache-{self.kind}-writer",
            head_first=self.chooses_victims,
            write=self._write_item,
            run_written=self._run_written,
        )
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ subclass primitives

    @abstractmethod
    def _exists(self, fingerprint: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has an entry (no verification). May raise."""

    @abstractmethod
    def _read_into(
        self, fingerprint: bytes, requests: Sequence[ReadRequest]
    ) -> list[bool | CorruptChunk]:
        """Read and verify each entry into ``request.out``.

        Returns, per request: ``True`` (read and verified with
        :func:`~lmcache.tiers.chunk_format.verify_chunk`), ``False`` (no entry), or the
        :class:`CorruptChunk` it failed with (the base deletes the entry and counts it). A
        request after a ``False`` or a failure may be skipped (reported ``False``). May raise
        (the whole batch is then a miss).
        """

    @abstractmethod
    def _write(
        self, fingerprint: bytes, key: bytes, header: bytes, payload: memoryview
    ) -> bool | None:
        """Store ``header + payload`` under the key, atomically (all or nothing). May raise.

        Returns ``False`` when the tier declines the chunk (e.g. it fits only by evicting its
        own prefix: it would be an orphan), counted in ``dropped_writes``; anything else means
        written.
        """

    def _chain_written(self, fingerprint: bytes, keys: list[bytes]) -> None:
        """Called after a run submitted with :meth:`submit_chain` was written head first
        (tiers with :attr:`chooses_victims`), with the keys written, in chain order, to mark
        them used tail first. No-op here. May raise (counted as a tier error)."""
        del fingerprint, keys

    @abstractmethod
    def _delete(self, fingerprint: bytes, key: bytes) -> None:
        """Delete the entry under the key if there is one. May raise."""

    @abstractmethod
    def _clear(self, fingerprint: bytes | None) -> None:
        """Delete every entry, or those stored under ``fingerprint``. May raise."""

    @abstractmethod
    def _close(self) -> None:
        """Release connections and files (after the write queue drained). May raise."""

    # ------------------------------------------------------------------ public API

    def check_quota(self, chunk_bytes: int) -> None:
        """Raise :class:`~lmcache.config.ConfigError` when this tier cannot hold one chunk of
        ``chunk_bytes`` (engines call it at start). No limit here; a tier with a quota
        overrides it."""
        del chunk_bytes  # no quota: any chunk fits

    @property
    def guard(self) -> TierGuard:
        """Runs this tier's reads under their deadline (and backs off after timeouts)."""
        return self._guard

    def _error(self, action: str, exc: BaseException, metrics: LMCacheMetrics) -> None:
        metrics.tier_errors.inc()
        if isinstance(exc, TierUnavailable):
            return  # backing off: its breaker logged when it opened
        if isinstance(exc, TierTimeout):
            metrics.tier_timeouts.inc()
            action += " in time"
        if action not in self._logged:
            self._logged.add(action)
            logger.warning(
                "lmcache %s tier failed to %s (%r); treating it as a miss (logged once).",
                self.kind,
                action,
                exc,
            )

    def contains(
        self, fingerprint: bytes, keys: Sequence[bytes], metrics: LMCacheMetrics
    ) -> list[bool]:
        """Whether each key has an entry; all ``False`` when the tier fails."""
        if not keys:
            return []
        try:
            found = self._guard.call(lambda: self._exists(fingerprint, keys))
        except Exception as exc:
            self._error("look up chunks", exc, metrics)
            return [False] * len(keys)
        return [bool(f) for f in found]

    def read_into(
        self, fingerprint: bytes, requests: Sequence[ReadRequest], metrics: LMCacheMetrics
    ) -> int:
        """Read the leading run of ``requests`` that is present and verifies.

        Returns:
            How many leading requests were read and verified (their ``out`` hold the chunks);
            the buffers of the others hold undefined bytes.
        """
        if not requests:
            return 0
        holds = [r.lease for r in requests if r.lease is not None]
        try:
            results = self._guard.call(
                lambda: self._read_and_clean(fingerprint, requests, metrics), holds
            )
        except Exception as exc:
            self._error("read chunks", exc, metrics)
            return 0
        done = 0
        for request, result in zip(requests, results, strict=False):
            if result is True:
                done += 1
                continue
            if isinstance(result, CorruptChunk):
                metrics.checksum_failures.inc()
                logger.warning(
                    "lmcache %s tier: chunk %s failed verification (%s); deleted it, and "
                    "treating it and every later chunk as a miss.",
                    self.kind,
                    request.key.hex(),
                    result,
                )
            break
        getattr(metrics, f"{self.kind}_hit_chunks").inc(done)
        return done

    def _read_and_clean(
        self, fingerprint: bytes, requests: Sequence[ReadRequest], metrics: LMCacheMetrics
    ) -> list[bool | CorruptChunk]:
        """:meth:`_read_into`, then delete the first entry that failed verification (on the
        guard's thread: a delete may hang like a read)."""
        results = self._read_into(fingerprint, requests)
        for request, result in zip(requests, results, strict=False):
            if result is True:
                continue
            if isinstance(result, CorruptChunk):
                try:
                    self._delete(fingerprint, request.key)
                except Exception as exc:
                    self._error("delete a corrupt chunk", exc, metrics)
            break
        return results

    def submit_write(
        self,
        fingerprint: bytes,
        key: bytes,
        lease: MemoryLease,
        checksum: int | None,
        metrics: LMCacheMetrics,
    ) -> bool:
        """Queue a chunk for writing; returns ``False`` when it was dropped (queue full, closed).

        Args:
            fingerprint: :func:`~lmcache.tiers.chunk_format.fingerprint_digest` of the storing
                engine's fingerprint.
            key: The chunk key.
            lease: The chunk's host buffer ``[num_layers, num_tokens, kv_width]``; a share is
                held until the write is done (the caller keeps its own).
            checksum: :func:`~lmcache.tiers.tensor_checksum` of the bytes if the caller has it
                (computed on the writer thread otherwise).
            metrics: Where the write's outcome is counted.
        """
        return self.submit_chain(fingerprint, [(key, lease, checksum)], metrics) == 1

    def submit_chain(
        self,
        fingerprint: bytes,
        chunks: Sequence[tuple[bytes, MemoryLease, int | None]],
        metrics: LMCacheMetrics,
        *,
        parents: Sequence[bytes | None] | None = None,
    ) -> int:
        """Queue a run of one key chain (chunk ``i`` before ``i + 1``) for writing.

        Chunks are admitted head first while the queue has room (the rest are dropped and
        counted: a prefix of a chain stays useful, a tail alone does not). A tier whose server
        chooses its victims gets them tail first, so the head is the most recently written; a
        tier that chooses its own (:attr:`chooses_victims`) gets them head first with their
        parents, and reorders them itself (see the module docstring).

        Args:
            fingerprint: As for :meth:`submit_write`.
            chunks: ``(key, lease, checksum)`` per chunk, in chain order; see
                :meth:`submit_write`.
            metrics: Where the writes' outcomes are counted.
            parents: Each chunk's chain parent (the previous chunk's key; ``None`` for a
                chain's head or when unknown), or ``None`` when no parent is known.

        Returns:
            How many leading chunks were queued.

        Raises:
            ValueError: ``parents`` is not one entry per chunk (a caller's bug, raised before
                anything is queued; tier failures are never raised).
        """
        if parents is not None and len(parents) != len(chunks):
            raise ValueError(
                f"LowerTier.submit_chain: {len(chunks)} chunks but {len(parents)} parents; pass "
                "one parent per chunk (None for a chain's head) or parents=None."
            )
        ups: Sequence[bytes | None] = [None] * len(chunks) if parents is None else parents
        return self._writes.submit(fingerprint, chunks, ups, metrics)

    def _run_written(self, item: QueuedWrite, keys: list[bytes]) -> None:
        """A head-first run is written: let the tier reorder it (:meth:`_chain_written`)."""
        try:
            self._chain_written(item.fingerprint, keys)
        except Exception as exc:
            self._error("mark chunks used", exc, item.metrics)

    def _write_item(self, item: QueuedWrite) -> bool:
        """Write one chunk; whether it was written (failures and refusals are counted)."""
        from lmcache.tiers.cpu_tier import tensor_checksum

        try:
            tensor = item.lease.tensor
            checksum = item.checksum if item.checksum is not None else tensor_checksum(tensor)
            shape = tuple(tensor.shape)
            if len(shape) != 3:
                raise ValueError(f"chunk buffer has shape {shape}, expected 3 dimensions")
            header = ChunkHeader(
                item.key,
                item.fingerprint,
                (shape[0], shape[1], shape[2]),
                tensor.dtype,
                item.lease.nbytes,
                checksum,
                item.parent,
            ).encode()
            payload = tensor.reshape(-1).view(torch.uint8).numpy().data
            if self._write(item.fingerprint, item.key, header, payload) is False:
                item.metrics.dropped_writes.inc()
                return False
        except Exception as exc:
            self._error("write a chunk", exc, item.metrics)
            return False
        getattr(item.metrics, f"{self.kind}_stored_chunks").inc()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; returns ``False`` on timeout."""
        return self._writes.flush(timeout)

    @property
    def queued_writes(self) -> int:
        """Writes queued or in progress."""
        return self._writes.pending

    def delete(self, fingerprint: bytes, key: bytes, metrics: LMCacheMetrics) -> None:
        """Delete one entry (errors counted, not raised)."""
        try:
            self._delete(fingerprint, key)
        except Exception as exc:
            self._error("delete a chunk", exc, metrics)

    def clear(self, fingerprint: bytes | None, metrics: LMCacheMetrics) -> None:
        """Delete every entry, or only those of one fingerprint, after queued writes finish.

        Writes queued before the call are flushed first (up to 10 s), so they cannot land after
        the clear. The clear itself runs under the read deadline (a hung mount never holds the
        caller; an abandoned clear finishes whenever the tier answers again).
        """
        self.flush(10.0)
        try:
            self._guard.call(lambda: self._clear(fingerprint))
        except Exception as exc:
            self._error("clear", exc, metrics)

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued writes (up to ``timeout`` s; the rest are dropped), then release."""
        if not self._writes.close(timeout):
            return  # closed before
        self._guard.close()
        try:
            self._close()
        except Exception as exc:
            logger.warning("lmcache %s tier: error while closing (%r).", self.kind, exc)
