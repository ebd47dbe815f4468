# SPDX-License-Identifier: Apache-2.0
"""Chunk buffers in the arrangements a connector must handle, for connector tests.

``adjacent``: back to back in one pool slab (the connector may merge their copies);
``scattered``: pool leases with gaps between them; ``strided``: non-contiguous host tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from lmcache.gpu_connector import GPUConnectorInterface
from lmcache.memory import HostMemoryPool

__all__ = ["chunk_buffers"]


@contextlib.contextmanager
def chunk_buffers(
    conn: GPUConnectorInterface, ranges: Sequence[tuple[int, int]], layout: str
) -> Iterator[list[torch.Tensor]]:
    """Zeroed buffers ``[num_layers, end - start, kv_width]``, one per ``(start, end)``.

    Pool leases are released when the context exits.
    """
    if layout == "strided":
        yield [
            torch.zeros(conn.kv_width, e - s, conn.num_layers, dtype=conn.dtype).permute(2, 1, 0)
            for s, e in ranges
        ]
        return
    if layout not in ("adjacent", "scattered"):
        raise ValueError(f"layout must be adjacent, scattered or strided, found {layout!r}")
    pool = HostMemoryPool(64 << 20, pin=False, slab_bytes=1 << 20)
    with contextlib.ExitStack() as stack:
        bufs = []
        for s, e in ranges:
            lease = pool.allocate(conn.chunk_shape(e - s), conn.dtype)
            assert lease is not None, "test pool too small"
            stack.enter_context(lease)
            if layout == "scattered":
                gap = pool.allocate((1000,), torch.uint8)
                assert gap is not None
                stack.enter_context(gap)
            lease.tensor.fill_(0)
            bufs.append(lease.tensor)
        yield bufs
