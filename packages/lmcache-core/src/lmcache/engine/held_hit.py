# SPDX-License-Identifier: Apache-2.0
"""A lookup hit whose chunks are leased until the caller lets go.

:meth:`lmcache.cache_engine.LMCacheEngine.lookup_and_lease` returns a :class:`HeldHit`: the
longest stored prefix of a request, each chunk checksum-verified once and leased. While the hit
is held its chunks cannot be evicted (the tier evicts only entries whose sole lease is its own),
so a scheduler can promise the engine ``num_tokens`` cached tokens and load exactly them later::

    hit = engine.lookup_and_lease(tokens)        # verified now
    ...                                          # other requests store and evict meanwhile
    with hit:
        loaded = engine.retrieve(tokens, mask, transfer, held=hit)  # not hashed again

A held lease stays valid bytes for its key even if the tier entry is removed or replaced
meanwhile (keys name their content), so :meth:`~lmcache.cache_engine.LMCacheEngine.retrieve`
uses it regardless.

A connector may start a device copy of the held chunks right after the lookup
(:attr:`HeldHit.prefetched`). Its DMA reads the leased host buffers, so the hit hands a lease
back only once :attr:`HeldHit.copy_done` says that copy has finished: a buffer handed back may
be filled by the next store at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import TracebackType

import torch

from lmcache.memory import LeaseError, MemoryLease

__all__ = ["HeldHit"]


class HeldHit:
    """Leases on the leading chunks of a request, from ``lookup_and_lease``.

    Args:
        chunks: ``(key, lease)`` of each held chunk, in chain order from chunk 0; the hit takes
            over the leases.
        num_tokens: Tokens those chunks cover.

    Attributes:
        num_tokens: Tokens covered by the held chunks (a stored partial last chunk counts).
        keys: Keys of the held chunks, in chain order.
    """

    def __init__(self, chunks: Sequence[tuple[bytes, MemoryLease]], num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.keys: list[bytes] = [key for key, _ in chunks]
        self._leases: dict[bytes, MemoryLease] = dict(chunks)
        self._lock = threading.Lock()
        self._released = False
        self.prefetched: object | None = None
        """Something derived from the held chunks that lives and dies with the hit (e.g. a
        connector's device copy of them, made right after the lookup); dropped at release."""
        self.copy_done: Callable[[], None] | None = None
        """Waits until every device copy that reads the held chunks (:attr:`prefetched`'s) has
        finished; :meth:`release` and :meth:`truncate` call it before handing leases back."""

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return self._released

    def __len__(self) -> int:
        """Number of held chunks."""
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self._leases

    def share(self, key: bytes) -> MemoryLease | None:
        """A new lease on the held chunk under ``key`` (the caller releases it), or ``None``.

        The bytes are not verified again: they were verified when the hit was taken.

        Raises:
            LeaseError: the hit was released.
        """
        with self._lock:
            if self._released:
                raise LeaseError(
                    f"HeldHit of {len(self.keys)} chunk(s) ({self.num_tokens} tokens) was "
                    "released; its chunks may have been evicted. Keep the hit until the retrieve "
                    "that uses it returns, or pass held=None."
                )
            lease = self._leases.get(key)
            return None if lease is None else lease.share()

    def tensors(self) -> list[torch.Tensor]:
        """The held chunks' host buffers, in chain order (valid while the hit is held).

        Raises:
            LeaseError: the hit was released.
        """
        with self._lock:
            if self._released:
                raise LeaseError(f"HeldHit of {len(self.keys)} chunk(s) was released")
            return [self._leases[key].tensor for key in self.keys]

    def checksums(self) -> list[int | None]:
        """The device checksum stored with each held chunk (``MemoryLease.checksum``), in
        chain order; ``None`` for a chunk stored without one.

        Raises:
            LeaseError: the hit was released.
        """
        with self._lock:
            if self._released:
                raise LeaseError(f"HeldHit of {len(self.keys)} chunk(s) was released")
            return [self._leases[key].checksum for key in self.keys]

    def truncate(self, num_chunks: int, num_tokens: int) -> None:
        """Keep only the first ``num_chunks`` chunks, covering ``num_tokens`` tokens, and
        release the leases of the others (e.g. from a chunk that failed its checksum on).

        Raises:
            ValueError: ``num_chunks`` is not within ``0 .. len(self)``.
        """
        if not 0 <= num_chunks <= len(self.keys):
            raise ValueError(
                f"HeldHit.truncate({num_chunks}): expected 0 <= num_chunks <= {len(self.keys)}."
            )
        with self._lock:
            dropped = [self._leases.pop(key) for key in self.keys[num_chunks:]]
            self.keys = self.keys[:num_chunks]
            self.num_tokens = num_tokens
            copy_done = self.copy_done if dropped else None
        try:
            if copy_done is not None:
                copy_done()
        finally:
            for lease in dropped:
                lease.release()

    def release(self) -> None:
        """Release every held lease (idempotent); the chunks become evictable again."""
        with self._lock:
            if self._released:
                return
            self._released = True
            leases = list(self._leases.values())
            self._leases.clear()
            self.prefetched = None
            copy_done, self.copy_done = self.copy_done, None
        try:
            if copy_done is not None:
                copy_done()
        finally:
            for lease in leases:
                lease.release()

    def __enter__(self) -> HeldHit:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"HeldHit(num_tokens={self.num_tokens}, chunks={len(self.keys)}, {state})"
