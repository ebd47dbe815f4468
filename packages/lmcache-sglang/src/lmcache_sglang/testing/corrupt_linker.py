# SPDX-License-Identifier: Apache-2.0
"""A test-only linker that loads noise instead of the stored pages (the corrupted-load control).

End-to-end tests load it in place of :class:`lmcache_sglang.linker.LMCacheLinker` to show that
the pages the linker writes are what the model reads: with noise in them, greedy output changes.
"""

from __future__ import annotations

import torch

from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache_sglang.linker import LMCacheLinker

__all__ = ["CorruptingLinker"]


class CorruptingLinker(LMCacheLinker):
    """:class:`LMCacheLinker` whose loads write random values (scaled up) into the slots."""

    def _write_layer(self, layer: int, chunks: list[ChunkTransfer], spec: TransferSpec) -> None:
        noisy = [
            ChunkTransfer(c.start, c.end, (torch.randn(c.buffer.shape) * 8).to(c.buffer.dtype))
            for c in chunks
        ]
        super()._write_layer(layer, noisy, spec)
