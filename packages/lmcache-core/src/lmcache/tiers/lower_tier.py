# SPDX-License-Identifier: Apache-2.0
"""Tiers below the CPU one (local disk, Redis/Valkey): the shared contract and write queue.

A :class:`LowerTier` stores chunks as :mod:`lmcache.tiers.chunk_format` entries (header +
raw bytes) under ``(fingerprint digest, chunk key)``. Its public methods never raise: a tier that
fails, times out or holds a bad entry is a miss, counted in the caller's metrics
(``tier_errors``, ``checksum_failures``), and a bad entry is deleted. Subclasses implement the
``_exists`` / ``_read_into`` / ``_write`` / ``_delete`` / ``_clear`` primitives, which may
raise.

Writes are asynchronous: :meth:`LowerTier.submit_write` (one chunk) and
:meth:`LowerTier.submit_chain` (a run of one key chain: admitted head first, written tail first)
take a share of each chunk's host lease and queue it for one writer thread; when the queue holds
``write_queue_bytes`` already the write is dropped and counted (``dropped_writes``), never
blocking the caller. The lease is released
once the bytes are written (or dropped), so the host buffer cannot be reused under the write.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from lmcache.tiers.chunk_format import ChunkHeader, CorruptChunk

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
    """

    key: bytes
    out: torch.Tensor


@dataclass(eq=False)
class _Write:
    fingerprint: bytes
    key: bytes
    lease: MemoryLease
    checksum: int | None
    metrics: LMCacheMetrics


class LowerTier(ABC):
    """A chunk store below the CPU tier. Thread-safe; public methods never raise.

    Args:
        write_queue_bytes: Bytes of queued writes beyond which new writes are dropped (one write
            is always admitted into an empty queue).
    """

    #: ``"disk"`` or ``"remote"``: names this tier's metrics (``disk_hit_chunks``, ...) and logs.
    kind: ClassVar[str]

    def __init__(self, *, write_queue_bytes: int = 1 << 30) -> None:
        self._queue: deque[_Write] = deque()
        self._queued_bytes = 0
        self._busy = 0
        self._write_limit = write_queue_bytes
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None
        self._closed = False
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
    def _write(self, fingerprint: bytes, key: bytes, header: bytes, payload: memoryview) -> None:
        """Store ``header + payload`` under the key, atomically (all or nothing). May raise."""

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

    def _error(self, action: str, exc: BaseException, metrics: LMCacheMetrics) -> None:
        metrics.tier_errors.inc()
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
            found = self._exists(fingerprint, keys)
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
        try:
            results = self._read_into(fingerprint, requests)
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
                    "lmcache %s tier: chunk %s failed verification (%s); deleting it and "
                    "treating it and every later chunk as a miss.",
                    self.kind,
                    request.key.hex(),
                    result,
                )
                try:
                    self._delete(fingerprint, request.key)
                except Exception as exc:
                    self._error("delete a corrupt chunk", exc, metrics)
            break
        getattr(metrics, f"{self.kind}_hit_chunks").inc(done)
        return done

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
    ) -> int:
        """Queue a run of one key chain (chunk ``i`` before ``i + 1``) for writing.

        Chunks are admitted head first while the queue has room (the rest are dropped and
        counted: a prefix of a chain stays useful, a tail alone does not), then written tail
        first, so the head is the most recently written and an LRU tier evicts a prompt's tail
        before its head.

        Args:
            fingerprint: As for :meth:`submit_write`.
            chunks: ``(key, lease, checksum)`` per chunk, in chain order; see
                :meth:`submit_write`.
            metrics: Where the writes' outcomes are counted.

        Returns:
            How many leading chunks were queued.
        """
        admitted: list[_Write] = []
        with self._cond:
            queued = self._queued_bytes
            for key, lease, checksum in chunks:
                if self._closed or (
                    (self._queue or admitted) and queued + lease.nbytes > self._write_limit
                ):
                    break
                admitted.append(_Write(fingerprint, key, lease.share(), checksum, metrics))
                queued += lease.nbytes
            self._queue.extend(reversed(admitted))
            self._queued_bytes = queued
            if admitted and self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, name=f"lmcache-{self.kind}-writer", daemon=True
                )
                self._writer.start()
            self._cond.notify_all()
        if len(admitted) < len(chunks):
            metrics.dropped_writes.inc(len(chunks) - len(admitted))
        return len(admitted)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy += 1
            try:
                self._write_one(item)
            finally:
                nbytes = item.lease.nbytes
                item.lease.release()
                with self._cond:
                    self._busy -= 1
                    self._queued_bytes -= nbytes
                    self._cond.notify_all()

    def _write_one(self, item: _Write) -> None:
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
            ).encode()
            payload = tensor.reshape(-1).view(torch.uint8).numpy().data
            self._write(item.fingerprint, item.key, header, payload)
        except Exception as exc:
            self._error("write a chunk", exc, item.metrics)
            return
        getattr(item.metrics, f"{self.kind}_stored_chunks").inc()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; returns ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    @property
    def queued_writes(self) -> int:
        """Writes queued or in progress."""
        with self._cond:
            return len(self._queue) + self._busy

    def delete(self, fingerprint: bytes, key: bytes, metrics: LMCacheMetrics) -> None:
        """Delete one entry (errors counted, not raised)."""
        try:
            self._delete(fingerprint, key)
        except Exception as exc:
            self._error("delete a chunk", exc, metrics)

    def clear(self, fingerprint: bytes | None, metrics: LMCacheMetrics) -> None:
        """Delete every entry, or only those of one fingerprint, after queued writes finish.

        Writes queued before the call are flushed first (up to 10 s), so they cannot land after
        the clear.
        """
        self.flush(10.0)
        try:
            self._clear(fingerprint)
        except Exception as exc:
            self._error("clear", exc, metrics)

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued writes (up to ``timeout`` s; the rest are dropped), then release."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self.flush(timeout)
        with self._cond:
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for item in dropped:
            item.metrics.dropped_writes.inc()
            item.lease.release()
        writer = self._writer
        if writer is not None:
            writer.join(timeout)
        try:
            self._close()
        except Exception as exc:
            logger.warning("lmcache %s tier: error while closing (%r).", self.kind, exc)
