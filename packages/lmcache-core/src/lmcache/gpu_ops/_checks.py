# SPDX-License-Identifier: Apache-2.0
"""Argument checks of the ``torch.ops.lmcache`` ops, shared by every implementation.

:func:`check_copy` checks what the CUDA launcher checks (layers, dtypes, shapes, devices) from
tensor metadata only, so an implementation that must not wait for the device (the Triton port,
the vectorized torch ops) can run it. The values of the chunk offsets are checked on the host,
where they are built: :func:`check_chunk_offsets` (the wrappers call it on a list or CPU
tensor, the index builders on what they build). A device tensor of offsets is trusted.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CopyPlan",
    "build_chunk_offsets",
    "check_checksum_args",
    "check_chunk_offsets",
    "check_copy",
    "check_data_offsets",
    "check_host_offsets",
    "check_index",
    "describe",
]


def describe(t: torch.Tensor) -> str:
    """Shape, strides, dtype and device of ``t``, for error messages."""
    return f"shape {list(t.shape)} strides {list(t.stride())} {t.dtype} on {t.device}"


@dataclass(frozen=True)
class CopyPlan:
    """What a checked gather or scatter moves.

    Attributes:
        num_tokens: Staging tokens (``slots.numel()``).
        num_chunks: Chunks (``chunk_offsets.numel() - 1``).
        stage_layers: Layers of each chunk in staging.
        stage_layer0: Staging layer of the call's layer 0.
        row_bytes: Bytes of one token of one layer (``kv_width`` elements).
    """

    num_tokens: int
    num_chunks: int
    stage_layers: int
    stage_layer0: int
    row_bytes: int


def _check_layers(op: str, name: str, layers: Sequence[torch.Tensor], device: torch.device) -> None:
    for i, t in enumerate(layers):
        if t.device != device:
            raise ValueError(f"{op}: expected {name}[{i}] on {device}, found {t.device}.")
        if t.dim() != 4:
            raise ValueError(
                f"{op}: expected {name}[{i}] as a [num_pages, page_size, heads, head_size] view, "
                f"found {describe(t)}."
            )
        if t.stride(3) != 1 and t.shape[3] != 1:
            raise ValueError(
                f"{op}: expected {name}[{i}] to have a contiguous last axis (stride 1), found "
                f"{describe(t)}."
            )
        first = layers[0]
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise ValueError(
                f"{op}: expected every layer of {name} like {name}[0] ({describe(first)}), "
                f"found {name}[{i}] {describe(t)}."
            )


def check_index(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    """``t`` is a 1-D int64 tensor on ``device``."""
    if t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"{op}: expected {name} as a 1-D int64 tensor, found {describe(t)}.")
    if t.device != device:
        raise ValueError(f"{op}: expected {name} on {device} (the staging's), found {t.device}.")


def check_copy(
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
) -> CopyPlan:
    """Check a gather's or scatter's arguments from their metadata (no device wait).

    Raises:
        ValueError: an argument does not match (the message says what was expected).
    """
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
            f"({describe(k0)}), found {describe(v_caches[0])}."
        )
    check_index(op, "slots", slots, device)
    check_index(op, "chunk_offsets", chunk_offsets, device)
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
            f"found {describe(staging)}."
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
    num_chunks = chunk_offsets.numel() - 1
    if checksums is not None:
        if (
            checksums.dtype != torch.int64
            or not checksums.is_contiguous()
            or checksums.numel() != num_chunks
            or checksums.device != device
        ):
            raise ValueError(
                f"{op}: expected checksums as a contiguous int64 tensor of num_chunks = "
                f"{num_chunks} entries on {device}, found {describe(checksums)}."
            )
        if row_bytes % 8 and not (first_layer == 0 and nl == total_layers):
            raise ValueError(
                f"{op}: checksums of a layer range need rows of a multiple of 8 bytes; found "
                f"rows of {row_bytes} bytes and layers [{first_layer}, {first_layer + nl}) of "
                f"{total_layers}: move all layers in one call, or pass checksums=None."
            )
    return CopyPlan(
        num_tokens, num_chunks, stage_layers, first_layer if staging_full else 0, row_bytes
    )


def check_chunk_offsets(op: str, offsets: Sequence[int], num_tokens: int) -> None:
    """Chunk offsets run from 0 to ``num_tokens`` without decreasing (checked on the host).

    Args:
        op: The op or builder, for the message.
        offsets: ``[num_chunks + 1]`` staging token offsets (host values).
        num_tokens: Staging tokens (``slots.numel()``).

    Raises:
        ValueError: they do not, with what was expected, what was found and the fix.
    """
    bad = (
        not offsets
        or offsets[0] != 0
        or offsets[-1] != num_tokens
        or any(a > b for a, b in itertools.pairwise(offsets))
    )
    if bad:
        shown = f"{list(offsets[:8])}{'...' if len(offsets) > 8 else ''}"
        last = offsets[-1] if offsets else None
        raise ValueError(
            f"{op}: malformed chunk offsets: expected chunk_offsets non-decreasing from 0 to "
            f"num_tokens={num_tokens} ([num_chunks + 1] staging token offsets), found {shown} "
            f"(last {last}). Fix: build them as [0, *itertools.accumulate(chunk_token_counts)] with "
            "counts >= 0 that add up to len(slots)."
        )


def build_chunk_offsets(counts: Sequence[int], num_tokens: int | None = None) -> list[int]:
    """``[0, n_0, n_0 + n_1, ...]``: the chunk offsets of chunks of ``counts`` tokens, checked.

    Args:
        counts: Tokens of each chunk (host values).
        num_tokens: The staged token count they must add up to (``len(slots)``), if known.

    Raises:
        ValueError: a count is negative, or they do not add up to ``num_tokens``.
    """
    offsets = [0, *itertools.accumulate(int(n) for n in counts)]
    check_chunk_offsets(
        "build_chunk_offsets", offsets, offsets[-1] if num_tokens is None else num_tokens
    )
    return offsets


def check_data_offsets(
    op: str, offsets: Sequence[int], data: torch.Tensor, unit_bytes: int
) -> None:
    """Offsets of ``checksum_chunks`` (host values): non-decreasing, from 0 or more, within the
    data's bytes / ``unit_bytes``.

    Raises:
        ValueError: they are not, with what was expected, what was found and the fix.
    """
    nbytes = data.numel() * data.element_size()
    if unit_bytes <= 0:
        raise ValueError(f"{op}: expected unit_bytes > 0, found {unit_bytes}.")
    if (
        not offsets
        or offsets[0] < 0
        or offsets[-1] * unit_bytes > nbytes
        or any(a > b for a, b in itertools.pairwise(offsets))
    ):
        shown = f"{list(offsets[:8])}{'...' if len(offsets) > 8 else ''}"
        raise ValueError(
            f"{op}: expected offsets non-decreasing within the data's {nbytes} bytes / "
            f"unit_bytes={unit_bytes}, found {shown}. Fix: pass [num_chunks + 1] running "
            "offsets of the chunks, in units of unit_bytes."
        )


def check_host_offsets(op: str, offsets: torch.Tensor, num_tokens: int) -> None:
    """:func:`check_chunk_offsets` of a CPU tensor (reading it waits for nothing); a device
    tensor is trusted: its builder checked the values on the host."""
    if offsets.device.type == "cpu":
        check_chunk_offsets(op, [int(x) for x in offsets.tolist()], num_tokens)


def check_checksum_args(
    op: str, data: torch.Tensor, offsets: torch.Tensor, unit_bytes: int, out: torch.Tensor
) -> int:
    """Check ``checksum_chunks``' arguments (CPU offsets' values too); return the chunk count.

    Raises:
        ValueError: an argument does not match (the message says what was expected).
    """
    if not data.is_contiguous():
        raise ValueError(f"{op}: expected contiguous data, found {describe(data)}.")
    check_index(op, "offsets", offsets, data.device)
    if unit_bytes <= 0:
        raise ValueError(f"{op}: expected unit_bytes > 0, found {unit_bytes}.")
    count = offsets.numel() - 1
    if count < 0 or out.dtype != torch.int64 or out.numel() != count or not out.is_contiguous():
        raise ValueError(
            f"{op}: expected offsets [num_chunks + 1] and out as a contiguous int64 tensor of "
            f"num_chunks entries, found offsets {describe(offsets)}, out {describe(out)}."
        )
    if offsets.device.type == "cpu":
        check_data_offsets(op, [int(x) for x in offsets.tolist()], data, unit_bytes)
    return count
