# SPDX-License-Identifier: Apache-2.0
"""The staging plan of :class:`~lmcache_vllm.transfer.fused.transfer.FusedTransfer`: where the
chunks of one call lie in the chunk-major staging buffer, which gather/scatter ops and which host
copies move them, and the objects a transfer made ahead hands to a later one (:class:`Prefetched`,
:class:`PreparedStore`).

Plain data and pure functions of the chunk list; nothing here touches a device. This module never
imports vLLM.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec

__all__ = [
    "HostRun",
    "Prefetched",
    "PreparedStore",
    "StagingOp",
    "StagingPlan",
    "add_run",
    "piece_spans",
    "plan_chunks",
    "widen_rows",
]


_WIDE = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))


def widen_rows(t: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``t`` reinterpreted with the widest element that fits (fewer, larger elements for the
    index kernels, which copy elements as opaque bytes), keeping ``row_bytes`` whole."""
    isz = t.element_size()
    for w, dt in _WIDE:
        if w <= isz:
            break
        if row_bytes % w or (t.shape[-1] * isz) % w:
            continue
        try:
            return t.view(dt)
        except RuntimeError:
            continue
    return t


@dataclass
class StagingOp:
    """One gather/scatter: ``g`` consecutive staged chunks of ``n`` tokens from staging token
    ``pos``, layers ``[l0, l1)`` of the call's layers, tokens ``[t0, n)`` of each chunk."""

    pos: int
    g: int
    n: int
    t0: int
    l0: int
    l1: int
    piece: int


@dataclass
class HostRun:
    """Staging bytes ``[lo, lo + nbytes)`` <-> host bytes, moved with one copy.

    ``host`` is the first chunk's host tensor; ``count`` chunks lie back to back after it in one
    storage when ``count > 1`` (see :meth:`host_view`). A non-contiguous host tensor is copied
    through a staging view of its shape.

    ``rows`` > 1 makes it a strided (2D) run: ``rows`` copies of ``nbytes`` each, row ``i`` at
    staging byte ``lo + i * dev_pitch`` and host byte ``host.data_ptr() + i * host_pitch``, all in
    one host storage (e.g. layer group ``g`` of chunks that lie at a constant step in a pool
    slab). On CUDA it moves in one ``cudaMemcpy2DAsync``; ``row_hosts`` keeps each row's host
    tensor for the row-by-row fallback.
    """

    lo: int
    nbytes: int
    host: torch.Tensor
    contiguous: bool
    end_ptr: int
    storage_ptr: int
    piece: int
    count: int = 1
    rows: int = 1
    host_pitch: int = 0
    dev_pitch: int = 0
    row_hosts: list[torch.Tensor] = field(default_factory=list)

    def host_view(self) -> torch.Tensor:
        if not self.contiguous:
            return self.host
        flat = self.host.reshape(-1).view(torch.uint8)
        if self.count == 1:
            return flat
        return flat.as_strided((self.nbytes,), (1,), flat.storage_offset())

    def extend_2d(self, lo: int, nbytes: int, host: torch.Tensor, sptr: int) -> bool:
        """Append ``host`` as the next row of this run when it continues the run's steps on
        both sides (the second row sets them); ``False``: not a continuation."""
        if (
            not self.contiguous
            or self.count != 1
            or nbytes != self.nbytes
            or sptr != self.storage_ptr
            or not host.is_contiguous()
        ):
            return False
        first = self.host.data_ptr()
        ptr = host.data_ptr()
        if self.rows == 1:
            hp, dp = ptr - first, lo - self.lo
            if hp < nbytes or dp < nbytes:  # rows must not overlap (and go forwards)
                return False
            self.host_pitch, self.dev_pitch = hp, dp
            self.row_hosts = [self.host]
        elif (
            ptr != first + self.rows * self.host_pitch or lo != self.lo + self.rows * self.dev_pitch
        ):
            return False
        self.rows += 1
        self.row_hosts.append(host)
        self.end_ptr = ptr + nbytes
        return True


@dataclass
class StagingPlan:
    """Where the chunks of one call lie in the chunk-major staging buffer, and what moves.

    Staged chunk ``i`` owns staging tokens ``[pos_i, pos_i + n_i)`` and bytes ``[pos_i *
    row_bytes, (pos_i + n_i) * row_bytes)``, laid out ``[layers, n_i, kv_width]``. Ops and runs
    are grouped into ``pieces``: piece ``i``'s host copies may overlap piece ``i + 1``'s gather
    (or piece ``i - 1``'s scatter).
    """

    row_bytes: int
    layer_bytes: int  # bytes of one layer of one token
    tokens: list[tuple[int, int]]  # request token ranges of the staged chunks, in order
    total: int = 0
    ops: list[StagingOp] = field(default_factory=list)
    kept: list[tuple[int, int]] = field(default_factory=list)  # staging spans that move
    runs: list[HostRun] = field(default_factory=list)
    pieces: int = 0
    staged: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, buffer ptr)

    def token_ids(self) -> torch.Tensor:
        """``[total]`` int64: request token index of every staging token."""
        return torch.cat([torch.arange(a, b) for a, b in self.tokens])

    def kept_positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(a, b) for a, b in self.kept])


@dataclass
class Prefetched:
    """A device copy of whole chunks, all layers, in the chunk-major staging layout.

    Made by :meth:`~lmcache_vllm.transfer.fused.load.FusedLoad.prefetch` on ``stream``;
    complete once ``event`` is. A later load whose staged chunks are a run of these (same token
    ranges, same host buffers) scatters from ``staging`` instead of copying from the host. Copied in
    layer groups, ``layer_events`` holds ``(layer stop, event)`` per group, in order: a load of
    layers ``< stop`` waits only for that group's event.
    """

    staging: torch.Tensor
    chunks: list[tuple[int, int, int]]  # (start, end, host buffer ptr) of each chunk
    offsets: list[int]  # byte offset of each chunk in staging
    event: Any
    stream: Any
    layer_events: list[tuple[int, Any]] = field(default_factory=list)
    # (chunk stop, event) per piece of whole chunks, in order, when copied chunk by chunk
    chunk_events: list[tuple[int, Any]] = field(default_factory=list)
    # (weak reference to the transfer, chunk ranges and buffers) -> (plan, base, device indices)
    # of the last load from this copy: a layerwise load scatters it in several layer groups
    # with the same indices
    scatter_plan: tuple[Any, ...] | None = None
    # (start, end, host buffer ptr) -> the stored sum this device copy matched at lookup
    verified: dict[tuple[int, int, int], int] = field(default_factory=dict)

    def verified_all(self, chunks: Sequence[ChunkTransfer]) -> bool:
        """Whether every chunk with a stored sum was verified in this very device copy, against
        that sum (a load from it then scatters without a second check)."""
        return all(
            c.checksum is None
            or self.verified.get((c.start, c.end, c.buffer.data_ptr())) == c.checksum
            for c in chunks
        )

    def event_for(self, stop: int) -> Any:
        """The event after which layers ``0 .. stop - 1`` of every chunk are on the device."""
        for group_stop, event in self.layer_events:
            if group_stop >= stop:
                return event
        return self.event

    def base_for(self, plan: StagingPlan) -> int | None:
        """Byte offset in ``staging`` of ``plan``'s first staged chunk, or ``None`` unless the
        plan's staged chunks are consecutive chunks of this copy."""
        if not plan.staged:
            return None
        try:
            i = self.chunks.index(plan.staged[0])
        except ValueError:
            return None
        if self.chunks[i : i + len(plan.staged)] != plan.staged:
            return None
        return self.offsets[i]


@dataclass
class PreparedStore:
    """A store's plan and device slot indices, made by
    :meth:`~lmcache_vllm.transfer.fused.store.FusedStore.prepare`
    before the KV exists; valid for a copy of all layers of the same chunk list and slot
    mapping. ``uploaded``: CUDA event after the indices' upload."""

    layers: range
    chunks: Sequence[ChunkTransfer]
    slots: torch.Tensor
    plan: StagingPlan
    idx: torch.Tensor
    check: Callable[[], None]
    uploaded: Any
    kernel_index: Any = None  # the gather kernel's device index, when the store uses it
    strided_ready: bool = True  # ``idx`` / ``check`` are the strided path's (else raw slots)

    def matches(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool:
        """Whether the plan is the one of this call (all of it is reused)."""
        return (
            self.chunks is chunks and self.slots is transfer.slot_mapping and self.layers == layers
        )

    def indexes(self, plan: StagingPlan, transfer: TransferSpec) -> bool:
        """Whether the indices fit ``plan`` (the same chunks and slots; the layers may differ:
        a layerwise store uploads them once for all of its layers)."""
        return (
            self.slots is transfer.slot_mapping
            and self.plan.staged == plan.staged
            and self.plan.kept == plan.kept
        )


def plan_chunks(
    layers: range,
    chunks: Sequence[ChunkTransfer],
    skip: int,
    piece_bytes: int,
    *,
    num_layers: int,
    layer_bytes: int,
    default_piece_bytes: Callable[[int], int],
) -> StagingPlan:
    """Lay the chunks that move out in the staging buffer (chunk-major) and find the host
    copies: one per chunk, merged when host buffers lie back to back in one storage.

    ``piece_bytes``: cut into pieces of about this size (0: one piece; -1:
    ``default_piece_bytes(bytes staged)``); a chunk larger than a piece is cut by layers.
    ``num_layers``: the cache's layers; ``layer_bytes``: bytes of one layer of one token.
    """
    nl = len(layers)
    row_bytes = nl * layer_bytes
    plan = StagingPlan(row_bytes, layer_bytes, [])
    staged = []
    for c in chunks:
        t0 = min(max(skip - c.start, 0), c.num_tokens)
        if t0 < c.num_tokens:  # else the engine holds all of this chunk already
            staged.append((c, t0))
    if piece_bytes < 0:
        piece_bytes = default_piece_bytes(sum(c.num_tokens for c, _ in staged) * row_bytes)
    whole = layers.start == 0 and layers.stop == num_layers
    pos, piece, fill = 0, -1, 0
    for c, t0 in staged:
        n = c.num_tokens
        plan.staged.append((c.start, c.end, c.buffer.data_ptr()))
        if plan.tokens and plan.tokens[-1][1] == c.start:
            plan.tokens[-1] = (plan.tokens[-1][0], c.end)
        else:
            plan.tokens.append((c.start, c.end))
        if plan.kept and plan.kept[-1][1] == pos + t0:
            plan.kept[-1] = (plan.kept[-1][0], pos + n)
        else:
            plan.kept.append((pos + t0, pos + n))
        nbytes = n * row_bytes
        host = c.buffer if whole else c.buffer[layers.start : layers.stop]
        if piece_bytes > 0 and nbytes > piece_bytes and nl > 1:  # cut this chunk by layers
            k = min(nl, -(-nbytes // piece_bytes))
            bounds = [nl * i // k for i in range(k + 1)]
            for l0, l1 in itertools.pairwise(bounds):
                piece += 1
                plan.ops.append(StagingOp(pos, 1, n, t0, l0, l1, piece))
                add_run(
                    plan,
                    pos * row_bytes + l0 * n * layer_bytes,
                    (l1 - l0) * n * layer_bytes,
                    host[l0:l1],
                    piece,
                )
            fill = piece_bytes  # the next chunk starts a new piece
        else:
            if piece < 0 or (piece_bytes > 0 and fill + nbytes > piece_bytes and fill > 0):
                piece, fill = piece + 1, 0
            fill += nbytes
            last = plan.ops[-1] if plan.ops else None
            if (
                last is not None
                and last.piece == piece
                and t0 == 0
                and last.t0 == 0
                and last.n == n
                and last.l1 - last.l0 == nl
            ):
                last.g += 1
            else:
                plan.ops.append(StagingOp(pos, 1, n, t0, 0, nl, piece))
            add_run(plan, pos * row_bytes, nbytes, host, piece)
        pos += n
    plan.total = pos
    plan.pieces = piece + 1
    return plan


def piece_spans(plan: StagingPlan) -> list[tuple[int, int, int, int]]:
    """Per piece of a plan of whole chunks: ``(first, end)`` staged chunks and ``(first, end)``
    staging tokens.

    Raises:
        ValueError: a piece holds only some layers of a chunk.
    """
    spans: list[list[int]] = []
    chunk = 0
    for op in plan.ops:
        if op.l0 != 0 or op.l1 * plan.layer_bytes != plan.row_bytes:
            raise ValueError("piece_spans: expected pieces of whole chunks, found a cut chunk.")
        if not spans or spans[-1][4] != op.piece:
            spans.append([chunk, chunk, op.pos, op.pos, op.piece])
        chunk += op.g
        spans[-1][1], spans[-1][3] = chunk, op.pos + op.g * op.n
    return [(a, b, ta, tb) for a, b, ta, tb, _ in spans]


def add_run(plan: StagingPlan, lo: int, nbytes: int, host: torch.Tensor, piece: int) -> None:
    """Add the host copy of staging bytes ``[lo, lo + nbytes)`` <-> ``host`` to ``plan``:
    merged into the last run when it continues it (back to back, or the next row of a strided
    run), else a new run."""
    contiguous = host.is_contiguous()
    ptr = host.data_ptr()
    sptr = host.untyped_storage().data_ptr() if contiguous else 0
    last = plan.runs[-1] if plan.runs else None
    if (
        contiguous
        and last is not None
        and last.contiguous
        and last.rows == 1
        and last.piece == piece
        and last.end_ptr == ptr
        and last.storage_ptr == sptr
        and last.lo + last.nbytes == lo
    ):
        last.nbytes += nbytes
        last.end_ptr += nbytes
        last.count += 1
        return
    if (
        contiguous
        and last is not None
        and last.piece == piece
        and last.extend_2d(lo, nbytes, host, sptr)
    ):
        return
    plan.runs.append(HostRun(lo, nbytes, host, contiguous, ptr + nbytes, sptr, piece))
