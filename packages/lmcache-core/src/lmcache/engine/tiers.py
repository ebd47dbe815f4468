# SPDX-License-Identifier: Apache-2.0
"""What the cache engine and its helpers share: the tier stack, metrics and chunk geometry.

:class:`~lmcache.cache_engine.LMCacheEngine` builds one :class:`EngineTiers`.
It hands it to the helpers that acquire hits (:mod:`lmcache.engine.hits`), allocate and commit
stores (:mod:`lmcache.engine.stores`) and check loads (:mod:`lmcache.engine.load_checks`).
A tier that fails is a miss: :meth:`EngineTiers.tier_error` counts and logs it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache.tiers import CPUTier, cascade

if TYPE_CHECKING:
    from lmcache.metadata import LMCacheMetadata
    from lmcache.metrics import LMCacheMetrics

__all__ = ["EngineTiers"]

logger = logging.getLogger(__name__)


class EngineTiers:
    """The tiers of one engine, the metrics they count in, and the shape of its chunks.

    Args:
        stack: The tiers the engine cascades over.
        metadata: The model geometry (layers, KV width, dtype).
        chunk_size: Tokens per full chunk.

    The engine replaces :attr:`stack` when a new connector changes whether chunks are
    checksummed. The helpers read it on every call, so they follow.
    """

    def __init__(
        self, stack: cascade.TierStack, metadata: LMCacheMetadata, chunk_size: int
    ) -> None:
        self.stack = stack
        self.metadata = metadata
        self.chunk_size = chunk_size

    @property
    def tier(self) -> CPUTier:
        """The CPU tier."""
        return self.stack.cpu

    @property
    def metrics(self) -> LMCacheMetrics:
        """Where the engine counts."""
        return self.stack.metrics

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int]:
        """The host buffer shape ``[num_layers, num_tokens, kv_width]`` of a chunk."""
        return (self.metadata.num_layers, num_tokens, self.metadata.kv_width)

    def chunk_bytes(self) -> int:
        """Bytes of one full chunk."""
        layers, tokens, width = self.chunk_shape(self.chunk_size)
        return layers * tokens * width * self.metadata.kv_dtype.itemsize

    def tier_error(self, action: str, exc: Exception) -> None:
        """Count and log a CPU tier failure, which the caller treats as a miss."""
        self.metrics.tier_errors.inc()
        logger.warning("CPU tier failed to %s (%r); treating it as a miss.", action, exc)

    def touch(self, chain: Sequence[bytes]) -> None:
        """Mark a run of one key chain used, earlier chunks more recent (kept longer)."""
        if not chain:
            return
        try:
            self.tier.touch_many(chain)
        except Exception as exc:
            self.tier_error("mark chunks used", exc)

    def drop_bad_chunk(self, key: bytes) -> None:
        """Count a chunk whose bytes failed their checksum, and drop it from the CPU tier."""
        self.metrics.checksum_failures.inc()
        try:
            self.tier.remove(key)
        except Exception as exc:
            self.tier_error("drop a bad chunk", exc)
