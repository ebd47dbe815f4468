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


def _describe(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)} strides {list(t.stride())} {t.dtype} on {t.device}"


def _check_layers(op: str, name: str, layers: Sequence[torch.Tensor], device: torch.device) -> None:
    for i, t in enumerate(layers):
        if t.device != device:
            raise ValueError(f"{op}: expected {name}[{i}] on {device}, found {t.device}.")
        if t.dim() != 4:
            raise ValueError(
                f"{op}: expected {name}[{i}] as a [num_pages, page_size, heads, head_size] view, "
                f"found {_describe(t)}."
            )
        if t.stride(3) != 1 and t.shape[3] != 1:
            raise ValueError(
                f"{op}: expected {name}[{i}] to have a contiguous last axis (stride 1), found "
                f"{_describe(t)}."
            )
        first = layers[0]
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise ValueError(
                f"{op}: expected every layer of {name} like {name}[0] ({_describe(first)}), "
                f"found {name}[{i}] {_describe(t)}."
            )


def _check_index(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"{op}: expected {name} as a 1-D int64 tensor, found {_describe(t)}.")
    if t.device != device:
        raise ValueError(f"{op}: expected {name} on {device} (the staging's), found {t.device}.")


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
    """Validate like the CUDA op; return ``(offsets, stage_layers, stage_layer0, row_bytes)``."""
    device = staging.device
    if not k_caches:
        raise ValueError(f"{op}: expected at least one layer in k_caches, found none.")
    if v_caches and len(v_caches) != len(k_caches):
        raise ValueError(
            f"{op}: expected v_caches to hold 0 layers (MLA) or {len(k_caches)} like k_caches, "
            f"found {len(v_caches)}."
        )
    _check_layers(op, "k_caches", k_caches, device)
    _check_layers(op, "v_caches", v_caches, device)
    k0 = k_caches[0]
    if v_caches and (v_caches[0].shape[:3] != k0.shape[:3] or v_caches[0].dtype != k0.dtype):
        raise ValueError(
            f"{op}: expected v_caches with the pages, page size, heads and dtype of k_caches "
            f"({_describe(k0)}), found {_describe(v_caches[0])}."
        )
    _check_index(op, "slots", slots, device)
    _check_index(op, "chunk_offsets", chunk_offsets, device)
    nl = len(k_caches)
    if first_layer < 0 or total_layers < first_layer + nl:
        raise ValueError(
            f"{op}: expected 0 <= first_layer and first_layer + len(k_caches) <= total_layers, "
            f"found first_layer={first_layer}, {nl} layers, total_layers={total_layers}."
        )
    heads = k0.shape[2]
    head_v = v_caches[0].shape[3] if v_caches else 0
    width = heads * (k0.shape[3] + head_v)
    row_bytes = width * k0.element_size()
    num_tokens = slots.numel()
    stage_layers = total_layers if staging_full else nl
    if staging.dtype != k0.dtype or not staging.is_contiguous():
        raise ValueError(
            f"{op}: expected a contiguous staging tensor of dtype {k0.dtype} (the KV dtype), "
            f"found {_describe(staging)}."
        )
    expected = num_tokens * stage_layers * width
    if staging.numel() != expected:
        raise ValueError(
            f"{op}: expected staging of num_tokens * layers * kv_width = {num_tokens} * "
            f"{stage_layers} * {width} = {expected} elements (layout [chunk][layer][token]"
            f"[kv_width]), found {staging.numel()}."
        )
    if chunk_offsets.numel() < 1:
        raise ValueError(f"{op}: expected chunk_offsets [num_chunks + 1], found none.")
    offsets = [int(x) for x in chunk_offsets.tolist()]
    if (
        offsets[0] != 0
        or offsets[-1] != num_tokens
        or any(a > b for a, b in itertools.pairwise(offsets))
    ):
        raise ValueError(
            f"{op}: expected chunk_offsets non-decreasing from 0 to num_tokens={num_tokens}, "
            f"found {offsets[:8]}{'...' if len(offsets) > 8 else ''} (last {offsets[-1]})."
        )
    if checksums is not None:
        if (
            checksums.dtype != torch.int64
            or not checksums.is_contiguous()
            or checksums.numel() != len(offsets) - 1
            or checksums.device != device
        ):
            raise ValueError(
                f"{op}: expected checksums as a contiguous int64 tensor of num_chunks = "
                f"{len(offsets) - 1} entries on {device}, found {_describe(checksums)}."
            )
        if row_bytes % 8 and not (first_layer == 0 and nl == total_layers):
            raise ValueError(
                f"{op}: checksums of a layer range need rows of a multiple of 8 bytes; found "
                f"rows of {row_bytes} bytes and layers [{first_layer}, {first_layer + nl}) of "
                f"{total_layers}: move all layers in one call, or pass checksums=None."
            )
    return offsets, stage_layers, first_layer if staging_full else 0, row_bytes


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
    _check_index(op, "offsets", offsets, data.device)
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
            f"{_describe(out)}."
        )
    values = [
        _signed(chunk_checksum(raw[a * unit_bytes : b * unit_bytes]))
        for a, b in itertools.pairwise(offs)
    ]
    out.copy_(torch.tensor(values, dtype=torch.int64))
