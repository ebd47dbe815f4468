# SPDX-License-Identifier: Apache-2.0
"""The ``torch.ops.lmcache`` ops as vectorized torch: a fixed number of launches, no host wait.

Same arguments, in the same order, as the schemas, and the same bytes and checksums as
:mod:`lmcache.gpu_ops._ref` (the oracle the tests hold it to). Unlike the reference, nothing
here reads a device value on the host: the chunk of each token comes from ``searchsorted`` on
the device, skipped slots are handled with masks instead of ``nonzero``, and the chunk sums are
segment sums (``index_add_`` on int64, which wraps like the kernels' ``uint64`` atomics). The
offsets' values are therefore not checked here: the wrappers and the index builders check them
on the host where they are built (:func:`lmcache.gpu_ops._checks.check_chunk_offsets`).

Layers move in one indexing launch when they are views of one allocation at a uniform layer
stride (vLLM's one KV buffer, SGLang's HiCache buffers); separate allocations (SGLang's
per-layer pools) take one launch per layer. The checksum pass reads the staging after the copy,
in slices of :data:`SLICE_WORDS` words so its temporaries stay bounded: the launch count grows
with the bytes moved, never with the number of chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache.gpu_ops._checks import CopyPlan, check_checksum_args, check_copy, check_host_offsets
from lmcache.gpu_ops.mix64sum import _GOLDEN, _mix64_t, signed64

__all__ = ["SLICE_WORDS", "checksum_chunks", "gather_kv", "scatter_kv"]

SLICE_WORDS = 1 << 22
"""64-bit words summed per slice of the checksum pass (32 MiB of data, ~10x that in
temporaries)."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def _stacked(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[layers, num_pages, page_size, heads, head_size]`` integer view over every layer, when
    they are views of one storage at a uniform non-negative layer stride; else ``None``."""
    views = [_int_view(t) for t in layers]
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    storage = first.untyped_storage().data_ptr()
    if any(v.untyped_storage().data_ptr() != storage for v in views):
        return None
    step = views[1].storage_offset() - first.storage_offset()
    if step < 0 or any(
        v.storage_offset() != first.storage_offset() + i * step for i, v in enumerate(views)
    ):
        return None
    return first.as_strided(
        (len(views), *first.shape), (step, *first.stride()), first.storage_offset()
    )


def _token_rows(
    offsets: torch.Tensor, plan: CopyPlan, num_layers: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Staging row of every ``(layer, token)`` as ``[num_layers, num_tokens]`` int64, and per token
    whether its chunk is well formed (malformed device offsets: the row is not moved)."""
    t_all = torch.arange(plan.num_tokens, device=device)
    chunk = torch.searchsorted(offsets, t_all, right=True) - 1
    chunk = chunk.clamp(0, max(plan.num_chunks - 1, 0))
    a = offsets[chunk]
    b = offsets[chunk + 1]
    ok = (a >= 0) & (a <= t_all) & (t_all < b) & (b <= plan.num_tokens)
    n = b - a
    base = a * plan.stage_layers + t_all - a
    layer = torch.arange(num_layers, device=device).unsqueeze(1) + plan.stage_layer0
    rows = base.unsqueeze(0) + layer * n.unsqueeze(0)
    limit = plan.num_tokens * plan.stage_layers - 1
    return torch.where(ok.unsqueeze(0), rows, 0).clamp(0, max(limit, 0)), ok


class _Caches:
    """The call's K and V layers, addressed all at once where their memory allows."""

    def __init__(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        k0 = k_caches[0]
        self.k, self.v = list(k_caches), list(v_caches)
        self.heads, self.head_k = int(k0.shape[2]), int(k0.shape[3])
        self.head_v = int(v_caches[0].shape[3]) if v_caches else 0
        self.width_k = self.heads * self.head_k
        self.page_size = int(k0.shape[1])
        self.capacity = int(k0.shape[0]) * self.page_size
        self.k_all = _stacked(k_caches)
        self.v_all = _stacked(v_caches) if v_caches else None

    def read(self, page: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        """``[layers, tokens, kv_width]`` integer rows of ``(page, off)``."""
        parts = [self._read(self.k, self.k_all, page, off)]
        if self.v:
            parts.append(self._read(self.v, self.v_all, page, off))
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def write(self, page: torch.Tensor, off: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``[layers, tokens, kv_width]`` ``rows`` at ``(page, off)``."""
        self._write(self.k, self.k_all, page, off, rows[:, :, : self.width_k], self.head_k)
        if self.v:
            self._write(self.v, self.v_all, page, off, rows[:, :, self.width_k :], self.head_v)

    @staticmethod
    def _read(
        layers: list[torch.Tensor],
        stacked: torch.Tensor | None,
        page: torch.Tensor,
        off: torch.Tensor,
    ) -> torch.Tensor:
        t = page.numel()
        if stacked is not None:
            return stacked[:, page, off].reshape(len(layers), t, -1)
        return torch.stack([_int_view(x)[page, off].reshape(t, -1) for x in layers])

    def _write(
        self,
        layers: list[torch.Tensor],
        stacked: torch.Tensor | None,
        page: torch.Tensor,
        off: torch.Tensor,
        rows: torch.Tensor,
        head: int,
    ) -> None:
        vals = rows.reshape(len(layers), page.numel(), self.heads, head)
        if stacked is not None:
            stacked[:, page, off] = vals
            return
        for i, x in enumerate(layers):
            _int_view(x)[page, off] = vals[i]


def _slot_index(
    slots: torch.Tensor, ok: torch.Tensor, caches: _Caches
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(valid, page, offset)`` of every token; skipped tokens point at slot 0."""
    valid = ok & (slots >= 0) & (slots < caches.capacity)
    s = torch.where(valid, slots, 0)
    page = torch.div(s, caches.page_size, rounding_mode="floor")
    return valid, page, s - page * caches.page_size


def gather_kv(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor,
    staging: torch.Tensor,
    checksums: torch.Tensor | None,
    first_layer: int,
    total_layers: int,
    staging_full: bool,
    max_sms: int,
) -> None:
    """Paged KV -> chunk-major staging; :func:`lmcache.gpu_ops._ref.gather_kv`'s contract.

    The rows of skipped tokens are read and written back unchanged (a masked write).
    ``max_sms`` is ignored.

    Raises:
        ValueError: an argument's metadata does not match (offsets' values are not read).
    """
    args = (k_caches, v_caches, slots, chunk_offsets, staging, checksums)
    plan = check_copy("gather_kv", *args, first_layer, total_layers, staging_full)
    check_host_offsets("gather_kv", chunk_offsets, plan.num_tokens)
    if plan.num_tokens and plan.num_chunks:
        caches = _Caches(k_caches, v_caches)
        rows, ok = _token_rows(chunk_offsets, plan, len(k_caches), staging.device)
        valid, page, off = _slot_index(slots, ok, caches)
        stage = _int_view(staging).view(-1, caches.width_k + caches.heads * caches.head_v)
        new = caches.read(page, off)
        stage[rows] = torch.where(valid.view(1, -1, 1), new, stage[rows])
    if checksums is not None:
        _copy_sums(
            staging, chunk_offsets, checksums, plan, len(k_caches), first_layer, total_layers
        )


def scatter_kv(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor,
    staging: torch.Tensor,
    checksums: torch.Tensor | None,
    first_layer: int,
    total_layers: int,
    staging_full: bool,
    max_sms: int,
) -> None:
    """Chunk-major staging -> paged KV; :func:`lmcache.gpu_ops._ref.scatter_kv`'s contract.

    Skipped tokens write the same slot and bytes as the first moved token (duplicate writes of
    identical bytes), or, when no token moves, slot 0's own bytes back: the write needs no
    host-side count of the moved tokens. ``max_sms`` is ignored.

    Raises:
        ValueError: an argument's metadata does not match (offsets' values are not read).
    """
    args = (k_caches, v_caches, slots, chunk_offsets, staging, checksums)
    plan = check_copy("scatter_kv", *args, first_layer, total_layers, staging_full)
    check_host_offsets("scatter_kv", chunk_offsets, plan.num_tokens)
    if plan.num_tokens and plan.num_chunks:
        caches = _Caches(k_caches, v_caches)
        rows, ok = _token_rows(chunk_offsets, plan, len(k_caches), staging.device)
        valid, page, off = _slot_index(slots, ok, caches)
        first = torch.argmax(valid.to(torch.int32))  # first moved token (0 when none moves)
        token = torch.where(valid, torch.arange(plan.num_tokens, device=staging.device), first)
        stage = _int_view(staging).view(-1, caches.width_k + caches.heads * caches.head_v)
        vals = stage[rows[:, token]]
        page, off = page[token], off[token]
        keep = caches.read(page[:1], off[:1])  # no token moves: slot 0's bytes go back
        # index_select, not valid[first]: indexing by a 0-d device tensor reads it on the host.
        vals = torch.where(valid.index_select(0, first.view(1)), vals, keep)
        caches.write(page, off, vals)
    if checksums is not None:
        _copy_sums(
            staging, chunk_offsets, checksums, plan, len(k_caches), first_layer, total_layers
        )


def _copy_sums(
    staging: torch.Tensor,
    chunk_offsets: torch.Tensor,
    checksums: torch.Tensor,
    plan: CopyPlan,
    num_layers: int,
    first_layer: int,
    total_layers: int,
) -> None:
    """Add each chunk's checksum terms of the call's layers in staging (the kernels' sums)."""
    if plan.num_chunks == 0:
        return
    a, b = chunk_offsets[:-1], chunk_offsets[1:]
    n = (b - a).clamp(min=0)
    good = (a >= 0) & (b >= a) & (b <= plan.num_tokens)
    rb = plan.row_bytes
    start = (a * plan.stage_layers + plan.stage_layer0 * n) * rb
    length = torch.where(good, num_layers * n * rb, 0)
    word1 = first_layer * n * rb // 8 + 1
    len_term = _mix64_t(total_layers * n * rb) if first_layer == 0 else torch.zeros_like(n)
    region = plan.num_tokens * plan.stage_layers * rb
    len_term = torch.where(good, len_term, 0)
    _region_sums(staging, start, length, word1, len_term, checksums, region, rb)


def _region_sums(
    data: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    word1: torch.Tensor,
    len_term: torch.Tensor,
    out: torch.Tensor,
    total_bytes: int,
    row_bytes: int,
) -> None:
    """``out[c] += len_term[c] + sum_i mix64(w_i XOR ((word1[c] + i) * golden))`` over the
    zero-padded words of bytes ``[start[c], start[c] + length[c])`` of contiguous ``data``.

    ``row_bytes`` divides every ``start`` and ``length`` (known on the host: the row or unit
    size). When it is a multiple of 8 and ``data`` is aligned, rows of whole words are summed
    (:func:`_row_sums`); else words are put together byte by byte. ``total_bytes`` bounds the
    sum of ``length`` (the host knows the work without reading the device).
    """
    if row_bytes % 8 == 0 and data.data_ptr() % 8 == 0:
        _row_sums(data, start, length, word1, out, row_bytes // 8)
    else:
        _byte_sums(data, start, length, word1, out, total_bytes)
    out.add_(len_term)


def _row_sums(
    data: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    word1: torch.Tensor,
    out: torch.Tensor,
    row_words: int,
) -> None:
    """Sum each row of ``row_words`` words, then a chunk's rows as a difference of running sums
    (int64 wraps: exact mod 2^64, and no atomics on a few chunk addresses)."""
    raw = data.reshape(-1).view(torch.uint8)
    num_rows = raw.numel() // (8 * row_words)
    rows = raw[: num_rows * 8 * row_words].view(torch.int64).view(num_rows, row_words)
    first = (start // (8 * row_words)).clamp(0, num_rows)
    last = (first + length // (8 * row_words)).clamp(0, num_rows)
    sums = torch.zeros(num_rows + 1, dtype=torch.int64, device=raw.device)
    lane = torch.arange(row_words, device=raw.device)
    step = max(1, SLICE_WORDS // row_words)
    for r0 in range(0, num_rows, step):
        r = torch.arange(r0, min(num_rows, r0 + step), device=raw.device)
        chunk = (torch.searchsorted(first, r, right=True) - 1).clamp(0, start.numel() - 1)
        index = (word1[chunk] + (r - first[chunk]) * row_words).unsqueeze(1) + lane
        term = _mix64_t(rows[r0 : r0 + r.numel()] ^ (index * signed64(_GOLDEN)))
        sums[r0 + 1 : r0 + 1 + r.numel()] = term.sum(dim=1)
    running = torch.cumsum(sums, 0)
    out.add_(running[last] - running[first])


def _byte_sums(
    data: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    word1: torch.Tensor,
    out: torch.Tensor,
    total_bytes: int,
) -> None:
    """Words put together byte by byte: regions that do not start on 8-byte addresses."""
    raw = data.reshape(-1).view(torch.uint8)
    nbytes = raw.numel()
    c_count = start.numel()
    words_c = (length + 7) // 8
    ends = torch.cumsum(words_c, 0)
    begins = ends - words_c
    max_words = (total_bytes + 7) // 8 + c_count
    lane = torch.arange(8, device=raw.device)
    for w0 in range(0, max_words, SLICE_WORDS):
        w = torch.arange(w0, min(max_words, w0 + SLICE_WORDS), device=raw.device)
        chunk = torch.searchsorted(ends, w, right=True)
        inside = chunk < c_count
        chunk = chunk.clamp(max=c_count - 1)
        local = w - begins[chunk]
        pos = (start[chunk] + 8 * local).unsqueeze(1) + lane
        byte = raw[pos.clamp(0, max(nbytes - 1, 0))].to(torch.int64)
        byte = torch.where(pos < (start[chunk] + length[chunk]).unsqueeze(1), byte, 0)
        word = (byte << (8 * lane)).sum(dim=1)
        term = _mix64_t(word ^ ((word1[chunk] + local) * signed64(_GOLDEN)))
        out.index_add_(0, chunk, torch.where(inside, term, 0))


def checksum_chunks(
    data: torch.Tensor, offsets: torch.Tensor, unit_bytes: int, out: torch.Tensor
) -> None:
    """``out[c]`` = checksum of bytes ``[offsets[c] * unit_bytes, offsets[c + 1] * unit_bytes)``
    of contiguous ``data``; :func:`lmcache.gpu_ops._ref.checksum_chunks`'s contract. A chunk
    whose offsets fall outside the data gets 0, as in the CUDA op.

    Raises:
        ValueError: an argument's metadata does not match (offsets' values are not read).
    """
    count = check_checksum_args("checksum_chunks", data, offsets, unit_bytes, out)
    out.zero_()
    nbytes = data.numel() * data.element_size()
    if count == 0 or nbytes == 0:
        return
    a, b = offsets[:-1], offsets[1:]
    good = (a >= 0) & (b >= a) & (b <= nbytes // unit_bytes)
    start = a * unit_bytes
    length = torch.where(good, (b - a) * unit_bytes, 0)
    word1 = torch.ones_like(a)
    _region_sums(data, start, length, word1, _mix64_t(length), out, nbytes, unit_bytes)
