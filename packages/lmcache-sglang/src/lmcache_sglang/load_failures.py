# SPDX-License-Identifier: Apache-2.0
"""Which pages of a load failed their device sum: the connector's verdicts, the sums it returned,
or a host hash of a sum it left unchecked (used by :class:`~lmcache_sglang.page_store.PageStore`).
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache.gpu_connector.checksums import LoadChecks
from lmcache.gpu_connector.interface import ChunkTransfer
from lmcache.gpu_ops import chunk_checksum

__all__ = ["load_failures"]


def load_failures(chunks: Sequence[ChunkTransfer], checks: LoadChecks | None) -> list[int]:
    """Positions of the loaded ``chunks`` whose bytes did not match their device sum.

    A chunk the connector verified before its scatter counts as it said; the sums of a load of
    every layer are compared here; a sum the connector did not check is hashed on the host.
    """
    if all(c.checksum is None for c in chunks):
        return []
    checked: set[int] = set()
    failed: set[int] = set()
    if checks is not None and checks.verified:
        for pos, ok in zip(checks.chunks, checks.ok(), strict=True):
            checked.add(pos)
            if not ok:
                failed.add(pos)
    elif checks is not None:  # the sums of every layer: this load moved all of them
        for pos, value in zip(checks.chunks, checks.sums(), strict=True):
            checked.add(pos)
            if value != chunks[pos].checksum:
                failed.add(pos)
    for pos, chunk in enumerate(chunks):
        unchecked = chunk.checksum is not None and pos not in checked
        if unchecked and chunk_checksum(chunk.buffer) != chunk.checksum:
            failed.add(pos)
    return sorted(failed)
