# SPDX-License-Identifier: Apache-2.0
"""How the cache engine checks the chunks it loaded against their checksums, and counts them.

A loaded chunk whose bytes do not match the checksum stored with them is a miss.
The connector may have checked it on the device before its scatter, or summed it layer by layer.
A chunk the connector did not check is hashed here, on the host.
Each bad chunk is counted in ``checksum_failures`` and dropped from the CPU tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from lmcache.engine.chunk_moves import Pending
from lmcache.engine.tiers import EngineTiers
from lmcache.gpu_connector.checksums import LoadChecks
from lmcache.gpu_ops._ref import chunk_checksum
from lmcache.gpu_ops.mix64sum import unsigned64

__all__ = ["LoadChecker", "mismatched_chunks"]

logger = logging.getLogger(__name__)


def mismatched_chunks(
    expected: Sequence[int | None],
    tensors: Sequence[torch.Tensor],
    checks: Sequence[LoadChecks | None],
    num_layers: int,
    moved: Sequence[bool] | None = None,
) -> list[int]:
    """Positions of loaded chunks whose bytes did not match their ``expected`` checksum.

    A chunk the connector verified before its scatter counts as it said. Partial sums of layer
    calls are added up and compared once they cover ``num_layers``. A chunk with a checksum
    that the connector did not check is hashed on the host (``tensors``), unless ``moved``
    says none of its tokens were loaded.
    """
    if all(e is None for e in expected):
        return []
    checked: set[int] = set()
    failed: set[int] = set()
    partial: dict[int, list[int]] = {}  # position -> [sum so far, layers covered]
    for check in checks:
        if check is None:
            continue
        if check.verified:
            for pos, ok in zip(check.chunks, check.ok(), strict=True):
                checked.add(pos)
                if not ok:
                    failed.add(pos)
            continue
        for pos, value in zip(check.chunks, check.sums(), strict=True):
            acc = partial.setdefault(pos, [0, 0])
            acc[0] += value
            acc[1] += len(check.layers)
    for pos, (total, layers) in partial.items():
        if pos not in checked and layers == num_layers:
            checked.add(pos)
            if unsigned64(total) != expected[pos]:
                failed.add(pos)
    for pos, want in enumerate(expected):
        if want is None or pos in checked or (moved is not None and not moved[pos]):
            continue
        if chunk_checksum(tensors[pos]) != want:  # a connector that does not verify
            failed.add(pos)
    return sorted(failed)


class LoadChecker:
    """Checks and counts the chunks of one engine's loads; a
    :class:`~lmcache.engine.chunk_moves.LoadFinisher`.

    Args:
        tiers: The engine's tiers, metrics and chunk geometry.
    """

    def __init__(self, tiers: EngineTiers) -> None:
        self._tiers = tiers

    def load_failures(
        self, pending: Sequence[Pending], checks: Sequence[LoadChecks | None], skip_tokens: int
    ) -> list[int]:
        """Positions of the loaded chunks whose bytes did not match their checksum.

        Call it after the connector's copies completed and before the leases go. A chunk the
        connector verified before its scatter counts as it said. Partial sums of layer calls
        are added up and compared. A chunk with a checksum that the connector did not check
        is hashed here, on the host. Each bad chunk is counted in ``checksum_failures`` and
        dropped from the CPU tier.
        """
        failed = mismatched_chunks(
            [p.chunk.checksum for p in pending],
            [p.lease.tensor for p in pending],
            checks,
            self._tiers.metadata.num_layers,
            moved=[p.chunk.end > skip_tokens for p in pending],
        )
        for pos in failed:
            logger.warning(
                "Checksum mismatch for chunk %s loaded from the CPU tier: its bytes changed "
                "after they were stored. Its tokens are reported as not loaded (the engine "
                "recomputes them) and the chunk is dropped.",
                pending[pos].key.hex(),
            )
            self._tiers.drop_bad_chunk(pending[pos].key)
        return failed

    def count_loaded(self, pending: Sequence[Pending], started: float) -> None:
        """Count the loaded chunks, their bytes and the time since ``started``."""
        metrics = self._tiers.metrics
        metrics.loaded_chunks.inc(len(pending))
        metrics.loaded_bytes.inc(sum(p.lease.nbytes for p in pending))
        metrics.retrieve_seconds.observe(time.perf_counter() - started)
