# SPDX-License-Identifier: Apache-2.0
"""Pure-torch reference ops between paged engine layouts and canonical chunk rows.

These are the CPU (and no-extension) fallback of the connectors and the oracle every CUDA/XPU
kernel is tested against bit-exactly. A *paged* cache tensor has a page axis and an in-page
offset axis somewhere among its axes; token ``i`` with engine slot ``s`` lives at
``page = s // page_size``, ``offset = s % page_size``. For example:

- ``[num_pages, page_size, kv_width]``: ``page_axis=0, offset_axis=1``.
- vLLM ``[num_blocks, kv_heads, block_size, head_size_k + head_size_v]`` (a view whose physical
  order may be LBNHC on CUDA): ``page_axis=0, offset_axis=2``.
- SGLang token pools ``[num_slots, heads, head_dim]``: view as
  ``[num_slots, 1, heads, head_dim]`` with ``page_size=1``, or use ``index_select`` directly.

Every op does one advanced-indexing operation on the (possibly non-contiguous) view, never a
per-token Python loop and never a reshape copy of the cache.
"""

from __future__ import annotations

import torch

__all__ = ["gather_paged", "pack_kv", "scatter_paged", "unpack_kv"]


def _normalize_axes(cache: torch.Tensor, page_axis: int, offset_axis: int) -> tuple[int, int]:
    ndim = cache.dim()
    axes = []
    for name, axis in (("page_axis", page_axis), ("offset_axis", offset_axis)):
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"{name}={axis} is out of range for a cache of {ndim} dims "
                f"{list(cache.shape)}; expected -{ndim} <= {name} < {ndim}."
            )
        axes.append(axis % ndim)
    if axes[0] == axes[1]:
        raise ValueError(
            f"page_axis and offset_axis must differ, both are axis {axes[0]} of "
            f"{list(cache.shape)}."
        )
    return axes[0], axes[1]


def _prepare(
    cache: torch.Tensor, slots: torch.Tensor, page_axis: int, offset_axis: int, page_size: int
) -> tuple[tuple[slice | torch.Tensor, ...], int]:
    """Return the indexing tuple and the axis at which the token dim lands in the result."""
    pa, oa = _normalize_axes(cache, page_axis, offset_axis)
    if cache.shape[oa] != page_size:
        raise ValueError(
            f"The offset axis {oa} of the cache {list(cache.shape)} has {cache.shape[oa]} "
            f"entries, expected page_size={page_size}; check offset_axis and page_size."
        )
    if slots.dim() != 1 or slots.dtype.is_floating_point or slots.dtype == torch.bool:
        raise ValueError(
            f"slots must be a 1-D integer tensor [num_tokens], found {list(slots.shape)} "
            f"{slots.dtype}."
        )
    capacity = cache.shape[pa] * page_size
    if slots.numel() > 0:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= capacity:
            raise ValueError(
                f"Slot mapping out of range: slots span [{lo}, {hi}] but the cache holds "
                f"{capacity} slots ({cache.shape[pa]} pages x page_size {page_size}); expected "
                f"0 <= slot < {capacity}. Pass only the slots of transferred tokens (no -1)."
            )
    slots = slots.to(device=cache.device, dtype=torch.long)
    index: list[slice | torch.Tensor] = [slice(None)] * cache.dim()
    index[pa] = torch.div(slots, page_size, rounding_mode="floor")
    index[oa] = torch.remainder(slots, page_size)
    # NumPy/torch rule: adjacent advanced indices put the token dim where they stand, separated
    # ones put it first.
    token_axis = min(pa, oa) if abs(pa - oa) == 1 else 0
    return tuple(index), token_axis


def gather_paged(
    cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    page_axis: int,
    offset_axis: int,
    page_size: int,
) -> torch.Tensor:
    """Read the entries of ``slots`` from a paged cache.

    Args:
        cache: Paged cache of any rank, e.g. ``[num_pages, heads, page_size, head_size]``; may be
            a non-contiguous view.
        slots: ``[num_tokens]`` integer engine slots (``page * page_size + offset``).
        page_axis: Axis of ``cache`` that indexes pages.
        offset_axis: Axis of ``cache`` that indexes the offset within a page.
        page_size: Tokens per page (``cache.shape[offset_axis]``).

    Returns:
        ``[num_tokens, *rest]`` where ``rest`` is the cache's other axes in order (a new tensor;
        possibly a non-contiguous view of it).

    Raises:
        ValueError: bad axes, ``page_size`` mismatch, or a slot outside ``[0, capacity)``.
    """
    index, token_axis = _prepare(cache, slots, page_axis, offset_axis, page_size)
    return cache[index].movedim(token_axis, 0)


def scatter_paged(
    cache: torch.Tensor,
    slots: torch.Tensor,
    values: torch.Tensor,
    *,
    page_axis: int,
    offset_axis: int,
    page_size: int,
) -> None:
    """Write ``values`` into the entries of ``slots`` of a paged cache, in place.

    Works on non-contiguous views (the write goes through to the underlying storage). Slots
    must be distinct; with duplicates, which value lands is unspecified.

    Args:
        cache: Paged cache, as for :func:`gather_paged`.
        slots: ``[num_tokens]`` integer engine slots.
        values: ``[num_tokens, *rest]``, same dtype as ``cache``.
        page_axis: Axis of ``cache`` that indexes pages.
        offset_axis: Axis of ``cache`` that indexes the offset within a page.
        page_size: Tokens per page.

    Raises:
        ValueError: as for :func:`gather_paged`, or ``values`` has the wrong shape/dtype.
    """
    index, token_axis = _prepare(cache, slots, page_axis, offset_axis, page_size)
    pa, oa = _normalize_axes(cache, page_axis, offset_axis)
    rest = [n for axis, n in enumerate(cache.shape) if axis not in (pa, oa)]
    expected = [slots.shape[0], *rest]
    if list(values.shape) != expected or values.dtype != cache.dtype:
        raise ValueError(
            f"scatter_paged: values must be {expected} {cache.dtype} ([num_tokens, *rest] of "
            f"the cache {list(cache.shape)}), found {list(values.shape)} {values.dtype}."
        )
    cache[index] = values.to(cache.device).movedim(0, token_axis)


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Pack per-head K and V into canonical rows (all K heads, then all V heads).

    Args:
        k: ``[num_tokens, heads, head_size_k]``.
        v: ``[num_tokens, heads, head_size_v]``, same dtype, tokens and heads.

    Returns:
        ``[num_tokens, heads * (head_size_k + head_size_v)]``.
    """
    if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2] or k.dtype != v.dtype:
        raise ValueError(
            "pack_kv: expected k [num_tokens, heads, head_size_k] and v "
            "[num_tokens, heads, head_size_v] with equal tokens, heads and dtype; found "
            f"k {list(k.shape)} {k.dtype}, v {list(v.shape)} {v.dtype}."
        )
    return torch.cat((k.flatten(1), v.flatten(1)), dim=1)


def unpack_kv(
    x: torch.Tensor, heads: int, head_size_k: int, head_size_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split canonical rows into K and V views (writes to them write ``x``).

    Args:
        x: ``[num_tokens, heads * (head_size_k + head_size_v)]``.
        heads: KV heads.
        head_size_k: Elements per K head.
        head_size_v: Elements per V head.

    Returns:
        ``(k, v)`` views of ``x``: ``[num_tokens, heads, head_size_k]`` and
        ``[num_tokens, heads, head_size_v]``.
    """
    width_k, width_v = heads * head_size_k, heads * head_size_v
    if x.dim() != 2 or x.shape[1] != width_k + width_v:
        raise ValueError(
            f"unpack_kv: expected x [num_tokens, {width_k + width_v}] (heads={heads} x "
            f"(head_size_k={head_size_k} + head_size_v={head_size_v})), found {list(x.shape)}."
        )
    k = x[:, :width_k].view(x.shape[0], heads, head_size_k)
    v = x[:, width_k:].view(x.shape[0], heads, head_size_v)
    return k, v
