# SPDX-License-Identifier: Apache-2.0
"""Pure-torch reference of the ``torch.ops.lmcache`` kernels.

Each op here takes the same arguments, in the same order, as its schema in
``lmcache/csrc/torch_bindings.cpp`` and has the same effect bit for bit: it is the fallback
(CPU, XPU, no CUDA toolkit, ``LMCACHE_DISABLE_CEXT=1``) and the oracle the CUDA kernels are
tested against. Bytes are copied as integers of the element's size, so every dtype (fp8
included) moves unchanged.

**Paged KV.** Layer ``i`` is ``k_caches[i]`` (and ``v_caches[i]``), a ``[num_pages, page_size,
heads, head_size]`` view of the engine's memory with any strides whose last axis is contiguous
(vLLM's ``[blocks, heads, block_size, head_k + head_v]`` is two such views, K and V, after a
transpose; SGLang's ``[slots, heads, head_dim]`` pools are ``[slots, 1, heads, head_dim]``;
:class:`lmcache.gpu_ops.PagedKV` builds them). ``v_caches`` is empty for MLA (one latent per
token). Token ``p`` of the staging lives at slot ``slots[p] = page * page_size + offset``; a
slot ``< 0`` or ``>= num_pages * page_size`` is skipped.

**Staging.** Chunk-major, the host chunk layout: chunk ``c`` (staging tokens ``[o_c,
o_{c+1})`` of ``chunk_offsets``, ``n_c`` of them) is ``[layers, n_c, kv_width]``, chunks back to
back, so a chunk moves to its host buffer in one DMA. ``kv_width = heads * (head_size_k +
head_size_v)``: all K heads, then all V heads. ``layers`` is ``total_layers`` when
``staging_full`` (call layer ``i`` sits at chunk layer ``first_layer + i``), else the call's
layer count.

**Checksum.** The ops that take ``checksums`` add the terms of ``lmcache-mix64-sum``, which
:mod:`lmcache.gpu_ops.mix64sum` defines (its names are re-exported here).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from lmcache.gpu_ops._checks import check_chunk_offsets, check_copy, check_index, describe
from lmcache.gpu_ops.mix64sum import (
    CHECKSUM_NAME,
    CHECKSUM_VERSION,
    chunk_checksum,
    chunk_checksum_py,
    mix64,
)
from lmcache.gpu_ops.mix64sum import bytes_of as _bytes_of
from lmcache.gpu_ops.mix64sum import signed64 as _signed
from lmcache.gpu_ops.mix64sum import word_sum as _word_sum

__all__ = [
    "CHECKSUM_NAME",
    "CHECKSUM_VERSION",
    "checksum_chunks",
    "chunk_checksum",
    "chunk_checksum_py",
    "gather_kv",
    "mix64",
    "scatter_kv",
]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element size (the same bytes and strides)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _plan(
    op: str,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor,
    staging: torch.Tensor,
    checksums: torch.Tensor | None,
    first_layer: int,
    total_layers: int,
    staging_full: bool,
) -> tuple[list[int], int, int, int]:
    """Validate like the CUDA op, the offsets' values included (read back here: the reference
    may wait); return ``(offsets, stage_layers, stage_layer0, row_bytes)``."""
    plan = check_copy(
        op,
        k_caches,
        v_caches,
        slots,
        chunk_offsets,
        staging,
        checksums,
        first_layer,
        total_layers,
        staging_full,
    )
    offsets = [int(x) for x in chunk_offsets.tolist()]
    check_chunk_offsets(op, offsets, plan.num_tokens)
    return offsets, plan.stage_layers, plan.stage_layer0, plan.row_bytes


def _rows(
    offsets: list[int], stage_layers: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base, n)`` per staging token: its row in staging is ``base + layer * n``."""
    counts = torch.tensor([b - a for a, b in itertools.pairwise(offsets)])
    starts = torch.tensor(offsets[:-1])
    chunk = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    tok0, n = starts[chunk], counts[chunk]
    t = torch.arange(offsets[-1]) - tok0
    return (tok0 * stage_layers + t).to(device), n.to(device)


def _add_checksums(
    staging: torch.Tensor,
    checksums: torch.Tensor,
    offsets: list[int],
    stage_layers: int,
    stage_layer0: int,
    nl: int,
    row_bytes: int,
    first_layer: int,
    total_layers: int,
) -> None:
    data = staging.view(-1).view(torch.uint8)
    current = checksums.tolist()
    for c, (a, b) in enumerate(itertools.pairwise(offsets)):
        n = b - a
        if n == 0:
            continue
        start = (a * stage_layers + stage_layer0 * n) * row_bytes
        part = _word_sum(
            data[start : start + nl * n * row_bytes], first_layer * n * row_bytes // 8 + 1
        )
        if first_layer == 0:
            part += mix64(total_layers * n * row_bytes)
        current[c] = _signed(current[c] + part)
    checksums.copy_(torch.tensor(current, dtype=torch.int64))


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
    """Paged KV -> chunk-major staging (the reference of ``torch.ops.lmcache.gather_kv``).

    Args:
        k_caches: Per layer of the call, K as ``[num_pages, page_size, heads, head_size_k]``.
        v_caches: The same for V (``head_size_v``), or empty for MLA.
        slots: ``[num_tokens]`` int64 slot of each staging token; skipped when out of range.
        chunk_offsets: ``[num_chunks + 1]`` int64 staging token offsets, ``0 .. num_tokens``.
        staging: Contiguous, ``num_tokens * layers * kv_width`` elements of the KV dtype, laid
            out ``[chunk][layer][token][kv_width]`` (module docstring); the rows of skipped
            tokens are left as they are.
        checksums: ``[num_chunks]`` int64, or ``None``: the checksum terms of the staging bytes
            of these layers (after the copy) are added, mod 2^64.
        first_layer: Chunk layer of ``k_caches[0]``.
        total_layers: Layers of a full chunk.
        staging_full: Staging holds all ``total_layers`` layers of each chunk.
        max_sms: Ignored (the CUDA op's SM cap).

    Raises:
        ValueError: an argument does not match (the message says what was expected).
    """
    offsets, stage_layers, stage_layer0, row_bytes = _plan(
        "gather_kv",
        k_caches,
        v_caches,
        slots,
        chunk_offsets,
        staging,
        checksums,
        first_layer,
        total_layers,
        staging_full,
    )
    _copy(True, k_caches, v_caches, slots, staging, offsets, stage_layers, stage_layer0)
    if checksums is not None:
        _add_checksums(
            staging,
            checksums,
            offsets,
            stage_layers,
            stage_layer0,
            len(k_caches),
            row_bytes,
            first_layer,
            total_layers,
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
    """Chunk-major staging -> paged KV (the reference of ``torch.ops.lmcache.scatter_kv``).

    The arguments are :func:`gather_kv`'s; the caches are written (skipped slots untouched) and
    ``checksums`` get the terms of every staging row of these layers, skipped or not.

    Raises:
        ValueError: an argument does not match (the message says what was expected).
    """
    offsets, stage_layers, stage_layer0, row_bytes = _plan(
        "scatter_kv",
        k_caches,
        v_caches,
        slots,
        chunk_offsets,
        staging,
        checksums,
        first_layer,
        total_layers,
        staging_full,
    )
    _copy(False, k_caches, v_caches, slots, staging, offsets, stage_layers, stage_layer0)
    if checksums is not None:
        _add_checksums(
            staging,
            checksums,
            offsets,
            stage_layers,
            stage_layer0,
            len(k_caches),
            row_bytes,
            first_layer,
            total_layers,
        )


def _copy(
    gather: bool,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    staging: torch.Tensor,
    offsets: list[int],
    stage_layers: int,
    stage_layer0: int,
) -> None:
    if slots.numel() == 0:
        return
    k0 = k_caches[0]
    num_pages, page_size, heads, head_k = k0.shape
    head_v = v_caches[0].shape[3] if v_caches else 0
    width_k = heads * head_k
    rows = _int_view(staging).view(-1, width_k + heads * head_v)
    base, n = _rows(offsets, stage_layers, staging.device)
    valid = (slots >= 0) & (slots < num_pages * page_size)
    sel = valid.nonzero().squeeze(1)
    if sel.numel() == 0:
        return
    s = slots[sel]
    page = torch.div(s, page_size, rounding_mode="floor")
    off = s - page * page_size
    base, n = base[sel], n[sel]
    for i, k in enumerate(k_caches):
        row = base + (stage_layer0 + i) * n
        kk = _int_view(k)
        vv = _int_view(v_caches[i]) if v_caches else None
        if gather:
            parts = [kk[page, off].reshape(-1, width_k)]
            if vv is not None:
                parts.append(vv[page, off].reshape(-1, heads * head_v))
            rows[row] = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        else:
            vals = rows[row]
            kk[page, off] = vals[:, :width_k].reshape(-1, heads, head_k)
            if vv is not None:
                vv[page, off] = vals[:, width_k:].reshape(-1, heads, head_v)


def checksum_chunks(
    data: torch.Tensor, offsets: torch.Tensor, unit_bytes: int, out: torch.Tensor
) -> None:
    """``out[c]`` = checksum of bytes ``[offsets[c] * unit_bytes, offsets[c + 1] * unit_bytes)``
    of contiguous ``data`` (the reference of ``torch.ops.lmcache.checksum_chunks``).

    Args:
        data: Contiguous tensor of any dtype.
        offsets: ``[num_chunks + 1]`` int64, non-decreasing, within ``data``'s bytes / unit.
        unit_bytes: Bytes per offset unit (e.g. the bytes of one token of one chunk).
        out: ``[num_chunks]`` int64, overwritten (the checksums as int64 bits).

    Raises:
        ValueError: an argument does not match.
    """
    op = "checksum_chunks"
    raw = _bytes_of(data)
    check_index(op, "offsets", offsets, data.device)
    if unit_bytes <= 0:
        raise ValueError(f"{op}: expected unit_bytes > 0, found {unit_bytes}.")
    offs = [int(x) for x in offsets.tolist()]
    if (
        not offs
        or offs[0] < 0
        or offs[-1] * unit_bytes > raw.numel()
        or any(a > b for a, b in itertools.pairwise(offs))
    ):
        raise ValueError(
            f"{op}: expected offsets non-decreasing within the data's {raw.numel()} bytes / "
            f"unit_bytes={unit_bytes}, found {offs[:8]}{'...' if len(offs) > 8 else ''}."
        )
    if out.dtype != torch.int64 or out.numel() != len(offs) - 1 or not out.is_contiguous():
        raise ValueError(
            f"{op}: expected out as a contiguous int64 tensor of {len(offs) - 1} entries, found "
            f"{describe(out)}."
        )
    values = [
        _signed(chunk_checksum(raw[a * unit_bytes : b * unit_bytes]))
        for a, b in itertools.pairwise(offs)
    ]
    out.copy_(torch.tensor(values, dtype=torch.int64))
