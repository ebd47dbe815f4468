# SPDX-License-Identifier: Apache-2.0
"""Reference paged gather/scatter and K/V packing against explicit per-token loops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from lmcache.gpu_connector.reference import gather_paged, pack_kv, scatter_paged, unpack_kv

NUM_PAGES, PAGE_SIZE, HEADS, WIDTH = 6, 4, 3, 5


@dataclass(frozen=True)
class Layout:
    name: str
    make: Callable[[], torch.Tensor]  # the cache (possibly a non-contiguous view)
    page_axis: int
    offset_axis: int


def _cuda_lbnhc_view() -> torch.Tensor:
    # Physical [blocks, block_size, heads, C] viewed as [blocks, heads, block_size, C] (vLLM CUDA).
    return torch.randn(NUM_PAGES, PAGE_SIZE, HEADS, WIDTH).permute(0, 2, 1, 3)


def _layer_of_shared_buffer() -> torch.Tensor:
    # One layer of a [layers, blocks, heads, block_size, C] buffer: a strided view with offset.
    return torch.randn(2, NUM_PAGES, HEADS, PAGE_SIZE, WIDTH)[1]


LAYOUTS = [
    Layout("page-major", lambda: torch.randn(NUM_PAGES, PAGE_SIZE, WIDTH), 0, 1),
    Layout("head-before-offset", lambda: torch.randn(NUM_PAGES, HEADS, PAGE_SIZE, WIDTH), 0, 2),
    Layout("offset-before-head", lambda: torch.randn(NUM_PAGES, PAGE_SIZE, HEADS, WIDTH), 0, 1),
    Layout("lbnhc-viewed-as-bhnc", _cuda_lbnhc_view, 0, 2),
    Layout("layer-of-shared-buffer", _layer_of_shared_buffer, 0, 2),
    Layout("heads-outermost", lambda: torch.randn(HEADS, NUM_PAGES, PAGE_SIZE, WIDTH), 1, 2),
    Layout("offset-before-page", lambda: torch.randn(PAGE_SIZE, NUM_PAGES, WIDTH), 1, 0),
    Layout("negative-axes", lambda: torch.randn(NUM_PAGES, HEADS, PAGE_SIZE, WIDTH), -4, -2),
]


def _entry_index(cache: torch.Tensor, layout: Layout, slot: int) -> tuple[int | slice, ...]:
    index: list[int | slice] = [slice(None)] * cache.dim()
    index[layout.page_axis] = slot // PAGE_SIZE
    index[layout.offset_axis] = slot % PAGE_SIZE
    return tuple(index)


def _loop_gather(cache: torch.Tensor, layout: Layout, slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([cache[_entry_index(cache, layout, int(s))] for s in slots])


def _loop_scatter(
    cache: torch.Tensor, layout: Layout, slots: torch.Tensor, values: torch.Tensor
) -> None:
    for i, s in enumerate(slots):
        cache[_entry_index(cache, layout, int(s))] = values[i]


def _slots(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_PAGES * PAGE_SIZE, generator=g)[:n]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.name for lay in LAYOUTS])
@pytest.mark.parametrize("num_tokens", [1, 7, NUM_PAGES * PAGE_SIZE])
def test_gather_matches_loop(layout: Layout, num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    cache = layout.make()
    slots = _slots(num_tokens, num_tokens)
    got = gather_paged(
        cache,
        slots,
        page_axis=layout.page_axis,
        offset_axis=layout.offset_axis,
        page_size=PAGE_SIZE,
    )
    expected = _loop_gather(cache, layout, slots)
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


def _same_view(base: torch.Tensor, like: torch.Tensor, like_base: torch.Tensor) -> torch.Tensor:
    """The view of ``base`` that ``like`` is of ``like_base``."""
    offset = like.storage_offset() - like_base.storage_offset()
    return base.as_strided(like.shape, like.stride(), base.storage_offset() + offset)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.name for lay in LAYOUTS])
@pytest.mark.parametrize("num_tokens", [1, 7, NUM_PAGES * PAGE_SIZE])
def test_scatter_matches_loop_in_place(layout: Layout, num_tokens: int) -> None:
    torch.manual_seed(100 + num_tokens)
    cache = layout.make()
    base = cache._base if cache._base is not None else cache
    expected_base = base.clone()
    slots = _slots(num_tokens, 100 + num_tokens)
    values = torch.randn(_loop_gather(cache, layout, slots).shape)
    storage_ptr = cache.untyped_storage().data_ptr()

    scatter_paged(
        cache,
        slots,
        values,
        page_axis=layout.page_axis,
        offset_axis=layout.offset_axis,
        page_size=PAGE_SIZE,
    )
    _loop_scatter(_same_view(expected_base, cache, base), layout, slots, values)

    # In place, through the (possibly non-contiguous) view, into the buffer and nowhere else.
    assert cache.untyped_storage().data_ptr() == storage_ptr
    assert torch.equal(base, expected_base)


def test_scatter_then_gather_round_trips_bf16() -> None:
    torch.manual_seed(0)
    cache = torch.zeros(NUM_PAGES, HEADS, PAGE_SIZE, WIDTH, dtype=torch.bfloat16)
    slots = _slots(9, 3)
    values = torch.randn(9, HEADS, WIDTH).to(torch.bfloat16)
    scatter_paged(cache, slots, values, page_axis=0, offset_axis=2, page_size=PAGE_SIZE)
    back = gather_paged(cache, slots, page_axis=0, offset_axis=2, page_size=PAGE_SIZE)
    assert torch.equal(back.view(torch.int16), values.view(torch.int16))


def test_empty_slots() -> None:
    cache = torch.randn(NUM_PAGES, PAGE_SIZE, WIDTH)
    empty = torch.empty(0, dtype=torch.long)
    assert gather_paged(cache, empty, page_axis=0, offset_axis=1, page_size=PAGE_SIZE).shape == (
        0,
        WIDTH,
    )
    before = cache.clone()
    scatter_paged(
        cache, empty, torch.empty(0, WIDTH), page_axis=0, offset_axis=1, page_size=PAGE_SIZE
    )
    assert torch.equal(cache, before)


@pytest.mark.parametrize("bad_slot", [-1, NUM_PAGES * PAGE_SIZE])
def test_out_of_range_slot_rejected_without_writing(bad_slot: int) -> None:
    cache = torch.randn(NUM_PAGES, PAGE_SIZE, WIDTH)
    before = cache.clone()
    slots = torch.tensor([0, bad_slot, 5])
    capacity = str(NUM_PAGES * PAGE_SIZE)
    with pytest.raises(ValueError, match="out of range") as excinfo:
        gather_paged(cache, slots, page_axis=0, offset_axis=1, page_size=PAGE_SIZE)
    assert capacity in str(excinfo.value) and str(bad_slot) in str(excinfo.value)
    with pytest.raises(ValueError, match=capacity):
        scatter_paged(
            cache, slots, torch.randn(3, WIDTH), page_axis=0, offset_axis=1, page_size=PAGE_SIZE
        )
    assert torch.equal(cache, before)


def test_bad_arguments_rejected() -> None:
    cache = torch.randn(NUM_PAGES, PAGE_SIZE, WIDTH)
    slots = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="page_size=8"):
        gather_paged(cache, slots, page_axis=0, offset_axis=1, page_size=8)
    with pytest.raises(ValueError, match="must differ"):
        gather_paged(cache, slots, page_axis=1, offset_axis=1, page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="out of range for a cache of 3 dims"):
        gather_paged(cache, slots, page_axis=3, offset_axis=1, page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="1-D integer"):
        gather_paged(cache, slots.float(), page_axis=0, offset_axis=1, page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match=r"\[2, 5\] torch.float32"):
        scatter_paged(
            cache, slots, torch.randn(2, WIDTH + 1), page_axis=0, offset_axis=1, page_size=PAGE_SIZE
        )
    with pytest.raises(ValueError, match="float16"):
        scatter_paged(
            cache,
            slots,
            torch.randn(2, WIDTH).half(),
            page_axis=0,
            offset_axis=1,
            page_size=PAGE_SIZE,
        )


@pytest.mark.parametrize(("heads", "hk", "hv"), [(1, 4, 4), (3, 8, 2), (2, 5, 7)])
def test_pack_kv_canonical_order_and_unpack(heads: int, hk: int, hv: int) -> None:
    torch.manual_seed(heads)
    k, v = torch.randn(6, heads, hk), torch.randn(6, heads, hv)
    packed = pack_kv(k, v)
    assert packed.shape == (6, heads * (hk + hv))
    for t in range(6):  # explicit oracle: all K heads in order, then all V heads
        row = [k[t, h, i] for h in range(heads) for i in range(hk)]
        row += [v[t, h, i] for h in range(heads) for i in range(hv)]
        assert torch.equal(packed[t], torch.stack(row))
    k2, v2 = unpack_kv(packed, heads, hk, hv)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    k2.zero_()  # views: writes reach the packed rows
    assert torch.equal(packed[:, : heads * hk], torch.zeros(6, heads * hk))


def test_pack_unpack_shape_errors() -> None:
    with pytest.raises(ValueError, match="equal tokens, heads and dtype"):
        pack_kv(torch.randn(2, 3, 4), torch.randn(2, 2, 4))
    with pytest.raises(ValueError, match=r"\[num_tokens, 24\]"):
        unpack_kv(torch.randn(2, 25), 2, 8, 4)
