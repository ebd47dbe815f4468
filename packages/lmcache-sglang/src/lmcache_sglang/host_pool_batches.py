# SPDX-License-Identifier: Apache-2.0
"""A batch of HiCache host-pool pages in any order, moved with one torch call.

The connector's per-run path (:meth:`~lmcache_sglang.gpu_connector.SGLangKVConnector._runs`)
makes one copy per run of consecutive slots. Each torch copy releases the GIL and must take it
back, and beside SGLang's busy scheduler thread each take-back may wait the interpreter's switch
interval (5 ms): 128 scattered pages cost 128 such waits. Here the pool is one strided view
``[units, layers, n, parts, heads, dim]`` (a unit: the ``n`` slots of one chunk, a page in
HiCache) and the chunk buffers that ``allocate_many`` carved back to back are one strided view
``[chunks, layers, n, parts, heads, dim]``. A store is then one indexed gather into the buffers
(``aten.index`` with ``out=``) and a load one ``index_copy_`` per group of back-to-back buffers,
whatever the pages' order. ``index_select`` would copy page by page, each page a parallel region
of its own, and with the cores contended each region may stall: both ops used here run the
whole batch in one region.

Both views are read as the widest element (16 bytes where the strides allow) because both ops
copy element by element. A plan is only made where it saves calls: the pages are not one run of
slots (the per-run path moves those with one copy) and some buffers lie back to back. Anything
else (slots outside the pool, a chunk that is not one aligned unit, a load writing one unit
twice) gets ``None``, and the connector takes its per-run or indexed path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmcache.gpu_connector.interface import ChunkTransfer
from lmcache_sglang.kv_pools import Spans, TokenRows

__all__ = ["PageBatches", "page_batches"]

_WIDE = (torch.complex128, torch.int64, torch.int32, torch.int16)
"""Element types to read the bytes as, widest first (only ever copied, never computed on)."""

_gather = torch.ops.aten.index.Tensor_out
"""``_gather(units, [index], out=buffers)``: ``buffers[i] = units[index[i]]``, one call."""


@dataclass(frozen=True)
class PageBatches:
    """What one transfer moves: ``(pool units, unit index, buffers)`` batches, and ``(pool,
    buffer)`` pairs for a chunk a load's ``skip_tokens`` cuts (moved first, in chunk order).

    Attributes:
        batches: ``pool`` ``[units, ...]``, ``index`` int64 ``[k]``, ``buffers`` ``[k, ...]``.
        pairs: Views of one shape each, copied as they are.
    """

    batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    pairs: list[tuple[torch.Tensor, torch.Tensor]]

    def store(self) -> None:
        """Copy the pool's units into the buffers: one gather per batch."""
        for pool, buf in self.pairs:
            buf.copy_(pool)
        for units, index, bufs in self.batches:
            _gather(units, [index], out=bufs)

    def load(self) -> None:
        """Copy the buffers into the pool's units: one ``index_copy_`` per batch."""
        for pool, buf in self.pairs:
            pool.copy_(buf)
        for units, index, bufs in self.batches:
            units.index_copy_(0, index, bufs)


def _units(rows: TokenRows, layers: range, n: int, num_slots: int) -> torch.Tensor | None:
    """The pool as ``[num_slots // n, len(layers), n, parts, heads, dim]``, unit ``u`` being
    slots ``u * n .. (u + 1) * n - 1``, or ``None`` when units are not evenly spaced (a
    ``page_first_direct`` unit other than one page)."""
    layer, part, page, token, head, elem = rows.strides
    if page == token * rows.page_size:  # slots follow each other (always for ``token``)
        step = n * token
    elif n == rows.page_size:
        step = page
    else:
        return None
    return rows.anchor.as_strided(
        (num_slots // n, len(layers), n, *rows.shape),
        (step, layer, token, part, head, elem),
        rows.base + layers.start * layer,
    )


def _groups(chunks: list[ChunkTransfer]) -> list[tuple[int, int, int]] | None:
    """``(first, count, spacing)`` runs of ``chunks`` whose buffers lie in one storage, each
    ``spacing`` elements after the one before (no overlap), in order; ``None`` when no two
    chunks form one (nothing to batch)."""
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(chunks):
        b = chunks[i].buffer
        storage, offset, size = b.untyped_storage().data_ptr(), int(b.storage_offset()), b.numel()
        k, gap = 1, size
        while i + k < len(chunks):
            nxt = chunks[i + k].buffer
            off = int(nxt.storage_offset()) - offset
            step = off if k == 1 else gap
            if step < size or off != k * step or nxt.untyped_storage().data_ptr() != storage:
                break
            gap, k = step, k + 1
        out.append((i, k, gap))
        i += k
    return out if len(out) < len(chunks) else None


def _wide(units: torch.Tensor, bufs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both views read as the widest element type whose size divides their strides, offsets
    and last dimension (the ops then copy that many bytes per step)."""
    for dtype in _WIDE:
        if dtype.itemsize <= units.element_size():
            break
        try:
            return units.view(dtype), bufs.view(dtype)
        except RuntimeError:  # a stride, offset or size it does not divide
            continue
    return units, bufs


def page_batches(
    rows: TokenRows | None, layers: range, spans: Spans | None, num_slots: int
) -> PageBatches | None:
    """The batches moving layers ``layers`` of the ``spans`` (each chunk's run of pool slots,
    :func:`~lmcache_sglang.kv_pools.slot_spans`), or ``None`` for the connector's other paths
    (see the module docstring); ``num_slots`` is the pool's size."""
    if rows is None or spans is None:
        return None
    parts, heads, dim = rows.shape
    width = parts * heads * dim
    whole: list[ChunkTransfer] = []
    firsts: list[int] = []
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    n = 0
    for c, a, first, m in spans:
        buf = c.buffer
        if buf.dim() != 3 or buf.shape[0] < layers.stop or buf.shape[2] != width:
            return None  # (the connector checked the chunks' shapes and dtype before)
        if a > c.start:  # a load's first chunk, cut by ``skip``: one strided copy, first
            pool = rows.run(layers, first, m)
            if pool is None or whole or pairs:
                return None
            part = buf[layers.start : layers.stop, a - c.start :]
            pairs.append((pool, part.view(len(layers), m, parts, heads, dim).unsqueeze(0)))
            continue
        n = n or m
        if m != n or first % n or not buf.is_contiguous():
            return None
        whole.append(c)
        firsts.append(first)
    spaced = np.diff(np.asarray(firsts, dtype=np.int64))
    if not whole or bool(np.all(spaced == n)):
        return None  # one run of slots: the per-run path moves it with one copy per run
    groups = _groups(whole)
    units = _units(rows, layers, n, num_slots)
    if groups is None or units is None:
        return None
    index = torch.from_numpy(np.asarray(firsts, dtype=np.int64) // n)
    batches = []
    for i, k, gap in groups:
        ids = index[i : i + k]
        if len(np.unique(ids.numpy())) < k:
            return None  # one unit twice: the per-run order decides which bytes a load leaves
        b = whole[i].buffer
        bufs = b.as_strided(
            (k, len(layers), n, parts, heads, dim),
            (gap, n * width, width, heads * dim, dim, 1),
            b.storage_offset() + layers.start * n * width,
        )
        pool, bufs = _wide(units, bufs)
        batches.append((pool, ids, bufs))
    return PageBatches(batches, pairs)
