# SPDX-License-Identifier: Apache-2.0
"""Random paged KV in every layout the adapters use, for kernel tests (CUDA here, XPU in
lmcache-xpu) against :mod:`lmcache.gpu_ops._ref`.

:func:`random_kv` fills the engine-shaped buffers with random bytes (never zeros: they hide
unwritten outputs) and returns a :class:`RandomKV` whose :meth:`RandomKV.clone` rebuilds the
same views over copies, so a kernel and the reference can run on identical inputs and their
whole buffers can be compared bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lmcache.gpu_ops import PagedKV

__all__ = [
    "DTYPES",
    "LAYOUTS",
    "RandomKV",
    "bits",
    "poison_",
    "random_chunks",
    "random_kv",
    "random_slots",
]

LAYOUTS = (
    "vllm_nhd",
    "vllm_hnd",
    "vllm_mla",
    "sglang_nhd",
    "sglang_hnd",
    "sglang_mla",
    "hicache_layer_first",
    "hicache_page_first",
    "hicache_page_first_direct",
)
"""``vllm_*``: one buffer for all layers, per layer a ``[blocks, heads, block_size, hk + hv]``
view (``nhd``: physical ``[blocks, block_size, heads, C]``, FlashAttention's; ``hnd``: as
viewed) or ``[blocks, block_size, latent]`` (MLA). ``sglang_*``: separate per-layer K and V
pools ``[slots, heads, dim]`` (``nhd``) or ``[pages, heads, page_size, dim]`` (``hnd``), MLA
``[slots, 1, latent]``. ``hicache_*``: SGLang's HiCache buffers ``[2, layers, slots, heads,
dim]``, ``[2, slots, layers, heads, dim]`` and ``[2, pages, layers, page_size, heads, dim]``."""

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
"""KV storage dtypes the kernels are tested with."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element size (bit-exact comparisons: NaN
    payloads and fp8 included)."""
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def poison_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill contiguous ``t`` with random bytes, in place; returns ``t``."""
    raw = t.view(-1).view(torch.uint8)
    noise = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator)
    raw.copy_(noise.to(raw.device))
    return t


@dataclass
class RandomKV:
    """Random engine buffers and the :class:`PagedKV` views over them.

    Attributes:
        layout: One of :data:`LAYOUTS`.
        buffers: The allocations (contiguous), whose bytes are the whole state.
        build: Builds the views of ``layout`` over buffers of these shapes.
    """

    layout: str
    buffers: list[torch.Tensor]
    build: Callable[[Sequence[torch.Tensor]], PagedKV]

    @property
    def kv(self) -> PagedKV:
        return self.build(self.buffers)

    def clone(self) -> RandomKV:
        """The same bytes in new buffers (same views)."""
        return RandomKV(self.layout, [b.clone() for b in self.buffers], self.build)


def random_kv(
    layout: str,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    num_layers: int,
    num_pages: int,
    page_size: int,
    heads: int,
    head_size: int,
    head_size_v: int | None = None,
    generator: torch.Generator | None = None,
) -> RandomKV:
    """Random KV of ``layout``. ``head_size`` is the latent size for MLA; ``head_size_v``
    (default ``head_size``) applies to the vLLM and SGLang non-MLA layouts.

    SGLang token pools hold ``num_pages * page_size`` slots (page size 1 as the ops see them).
    """
    hv = head_size if head_size_v is None else head_size_v
    L, P, N, H, hk = num_layers, num_pages, page_size, heads, head_size
    shapes: Sequence[tuple[int, ...]]
    build: Callable[[Sequence[torch.Tensor]], PagedKV]
    if layout == "vllm_nhd":
        shapes = [(L, P, N, H, hk + hv)]

        def build(b: Sequence[torch.Tensor]) -> PagedKV:
            return PagedKV.from_vllm([b[0][i].permute(0, 2, 1, 3) for i in range(L)], hk)

    elif layout == "vllm_hnd":
        shapes = [(L, P, H, N, hk + hv)]

        def build(b: Sequence[torch.Tensor]) -> PagedKV:
            return PagedKV.from_vllm([b[0][i] for i in range(L)], hk)

    elif layout == "vllm_mla":
        shapes = [(L, P, N, hk)]

        def build(b: Sequence[torch.Tensor]) -> PagedKV:
            return PagedKV.from_vllm_mla([b[0][i] for i in range(L)])

    elif layout == "sglang_nhd":
        shapes = [(P * N, H, hk)] * L + [(P * N, H, hv)] * L

        def build(b: Sequence[torch.Tensor]) -> PagedKV:
            return PagedKV.from_sglang(b[:L], b[L:])

    elif layout == "sglang_hnd":
        shapes = [(P, H, N, hk)] * L + [(P, H, N, hv)] * L

        def build(b: Sequence[torch.Tensor]) -> PagedKV:
            return PagedKV.from_sglang(b[:L], b[L:])

    elif layout == "sglang_mla":
        shapes = [(P * N, 1, hk)] * L

        def build(b: Sequence[torch.Tensor]) -> PagedKV:
            return PagedKV.from_sglang_mla(b)

    elif layout == "hicache_layer_first":
        shapes = [(2, L, P * N, H, hk)]

        def build(b: Sequence[torch.Tensor]) -> PagedKV:
            return PagedKV.from_sglang(
                [b[0][0, i] for i in range(L)], [b[0][1, i] for i in range(L)]
            )

    elif layout == "hicache_page_first":
        shapes = [(2, P * N, L, H, hk)]

        def build(b: Sequence[torch.Tensor]) -> PagedKV:
            return PagedKV.from_sglang(
                [b[0][0, :, i] for i in range(L)], [b[0][1, :, i] for i in range(L)]
            )

    elif layout == "hicache_page_first_direct":
        shapes = [(2, P, L, N, H, hk)]

        def build(b: Sequence[torch.Tensor]) -> PagedKV:
            return PagedKV(
                tuple(b[0][0, :, i] for i in range(L)), tuple(b[0][1, :, i] for i in range(L))
            )

    else:
        raise ValueError(f"Unknown layout {layout!r}; expected one of {LAYOUTS}.")
    buffers = [poison_(torch.empty(s, dtype=dtype, device=device), generator) for s in shapes]
    return RandomKV(layout, buffers, build)


def random_slots(
    num_tokens: int,
    capacity: int,
    *,
    skip: float = 0.2,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[num_tokens]`` int64 distinct slots below ``capacity`` in random order, about ``skip``
    of them replaced by negative values (``-1`` or another negative)."""
    if num_tokens > capacity:
        raise ValueError(
            f"random_slots: {num_tokens} tokens need at least as many slots, found {capacity}."
        )
    slots = torch.randperm(capacity, generator=generator)[:num_tokens]
    drop = torch.rand(num_tokens, generator=generator) < skip
    neg = -torch.randint(1, 1 << 40, (num_tokens,), generator=generator)
    neg[::2] = -1
    return torch.where(drop, neg, slots)


def random_chunks(num_tokens: int, *, generator: torch.Generator | None = None) -> list[int]:
    """Random chunk offsets ``[0, ..., num_tokens]`` (chunks of 1 token and more)."""
    if num_tokens == 0:
        return [0]
    cuts = torch.randperm(max(num_tokens - 1, 0), generator=generator) + 1
    k = int(torch.randint(0, min(num_tokens, 6), (1,), generator=generator))
    inner = sorted(int(x) for x in cuts[:k])
    return [0, *inner, num_tokens]
