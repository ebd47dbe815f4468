# SPDX-License-Identifier: Apache-2.0
"""The connector's one-copy-per-chunk path over HiCache host pools equals the indexed path.

A HiCache host pool keeps every layer in one ``kv_buffer`` (``layer_first`` ``[2, layers,
slots, H, D]``, ``page_first`` ``[2, slots, layers, H, D]``, ``page_first_direct`` ``[2, pages,
layers, page, H, D]``; MLA without the leading 2), so :func:`~lmcache_sglang.kv_pools.token_rows`
describes it as one strided view, and a chunk whose slots are one run (a page, as HiCache hands
them) moves with one copy of all its layers. Every case here runs the same transfer with that
path and with it switched off (``connector.rows = None``: the indexed path), bit for bit: whole
pages in shuffled order, pages split by ``skip_tokens``, single layers, runs that cross pages
(``page_first_direct``: pages that do not follow each other fall back), scattered slots.
"""

from __future__ import annotations

import pytest
import torch

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import ChunkTransfer, EngineInfo, TransferSpec
from lmcache.metadata import LMCacheMetadata
from lmcache_sglang.gpu_connector import SGLangKVConnector
from lmcache_sglang.kv_pools import host_layer_views, token_rows

LAYERS, PAGES, PAGE, HEADS, DIM, LATENT = 3, 12, 4, 2, 8, 24
SLOTS = PAGES * PAGE
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _pool(layout: str, mla: bool) -> torch.Tensor:
    tail = (1, LATENT) if mla else (HEADS, DIM)
    dims = {
        "layer_first": (LAYERS, SLOTS, *tail),
        "page_first": (SLOTS, LAYERS, *tail),
        "page_first_direct": (PAGES, LAYERS, PAGE, *tail),
    }[layout]
    return torch.randn(dims if mla else (2, *dims)).to(torch.bfloat16)


def _connector(buf: torch.Tensor, layout: str, mla: bool) -> SGLangKVConnector:
    caches, kv_layout = host_layer_views(buf, layout, LAYERS, mla)
    md = LMCacheMetadata(
        model_name="m",
        world_size=1,
        worker_id=0,
        local_worker_id=0,
        local_world_size=1,
        kv_dtype=torch.bfloat16,
        num_layers=LAYERS,
        num_kv_heads=1 if mla else HEADS,
        head_size_k=LATENT if mla else DIM,
        head_size_v=0 if mla else DIM,
        use_mla=mla,
        chunk_size=PAGE,
    )
    engine = EngineInfo("sglang", "cpu", caches, {"page_size": PAGE})
    return SGLangKVConnector(
        LMCacheConfig(), md, engine, {"kv_layout": kv_layout, "page_size": PAGE}
    )


def _chunks(
    conn: SGLangKVConnector, sizes: list[int], back_to_back: bool = False
) -> list[ChunkTransfer]:
    """Chunks of ``sizes`` tokens with random buffers, allocated apart or back to back in one
    tensor (as ``allocate_many`` carves a run of page buffers)."""
    if back_to_back:
        shape = conn.chunk_shape(sizes[0])
        whole = torch.randn(len(sizes), *shape).to(torch.bfloat16)
        bufs = list(whole.unbind(0))
    else:
        bufs = [torch.randn(conn.chunk_shape(n)).to(torch.bfloat16) for n in sizes]
    out, start = [], 0
    for n, buf in zip(sizes, bufs, strict=True):
        out.append(ChunkTransfer(start, start + n, buf))
        start += n
    return out


def _page_slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


_SCATTERED = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(0))[: 3 * PAGE]

CASES: dict[str, tuple[torch.Tensor, list[int], int]] = {
    # name: (slot mapping, chunk sizes, skip_tokens of the load)
    "shuffled pages": (_page_slots([7, 2, 9, 4]), [PAGE] * 4, 0),
    "following pages": (_page_slots([4, 5, 6, 7]), [PAGE] * 4, 0),
    "following pages, skip inside the first": (_page_slots([4, 5, 6]), [PAGE] * 3, 2),
    "skip inside a page": (_page_slots([3, 1, 5]), [PAGE] * 3, PAGE + 1),
    "two-page chunks of following pages": (_page_slots([2, 3, 8, 9]), [2 * PAGE] * 2, 0),
    "two-page chunks of pages apart": (_page_slots([2, 5, 8, 1]), [2 * PAGE] * 2, 0),
    "scattered slots": (_SCATTERED, [PAGE] * 3, 0),
}


def _one_copy(layout: str, case: str) -> bool:
    """Whether every chunk is one run of the pool: whole pages always; two following pages in
    the token layouts only (in ``page_first_direct`` a page's other layers sit between them)."""
    if case in ("shuffled pages", "skip inside a page") or case.startswith("following pages"):
        return True
    return case == "two-page chunks of following pages" and layout != "page_first_direct"


def _pairs(layout: str, case: str, back_to_back: bool) -> int | None:
    """Copies the one-copy path makes: one per chunk, except chunks of following pages whose
    buffers lie back to back, which share one (a partial first chunk apart)."""
    if not _one_copy(layout, case):
        return None
    sizes = CASES[case][1]
    if back_to_back and case.startswith("following pages"):
        return 1
    if back_to_back and case == "two-page chunks of following pages":
        return 2  # pages 2-3 and 8-9: not one run of slots
    return len(sizes)


@pytest.mark.parametrize("back_to_back", [False, True], ids=["apart", "back_to_back"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_runs_match_the_indexed_path(layout: str, mla: bool, case: str, back_to_back: bool) -> None:
    slots, sizes, skip = CASES[case]
    buf = _pool(layout, mla)
    fast_pool, slow_pool = buf.clone(), buf.clone()
    fast, slow = _connector(fast_pool, layout, mla), _connector(slow_pool, layout, mla)
    assert fast.rows is not None, "a host pool's layers share one buffer"
    slow.rows = None
    spec = TransferSpec(slots)
    whole = _chunks(fast, sizes, back_to_back)
    spans = fast._spans(whole, spec, 0)
    runs = None if spans is None else fast._runs(range(LAYERS), spans)
    assert (None if runs is None else len(runs)) == _pairs(layout, case, back_to_back)

    # store: the chunks' buffers
    a, b = _chunks(fast, sizes, back_to_back), _chunks(slow, sizes)
    fast.from_gpu(a, spec)
    slow.from_gpu(b, spec)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.buffer, y.buffer)
    assert torch.equal(a[0].buffer[:, 0], _reference_rows(buf, layout, mla, int(slots[0])))

    # load every layer from ``skip`` on, then one layer alone: the pools
    chunks = _chunks(fast, sizes, back_to_back)
    if back_to_back and case == "following pages, skip inside the first":
        spans = fast._spans(chunks, TransferSpec(slots, skip_tokens=skip), skip)
        assert spans is not None
        loads = fast._runs(range(LAYERS), spans)
        assert loads is not None and len(loads) == 2  # the first page's tail, then the others
    fast.to_gpu(chunks, TransferSpec(slots, skip_tokens=skip))
    slow.to_gpu(chunks, TransferSpec(slots, skip_tokens=skip))
    other = _chunks(fast, sizes, back_to_back)
    fast.to_gpu_layer(1, other, spec)
    slow.to_gpu_layer(1, other, spec)
    assert torch.equal(fast_pool, slow_pool)
    assert not torch.equal(fast_pool, buf)


def _reference_rows(buf: torch.Tensor, layout: str, mla: bool, slot: int) -> torch.Tensor:
    """``[layers, kv_width]`` of ``slot``, read from the pool by hand."""
    page, off = divmod(slot, PAGE)
    parts = [buf] if mla else [buf[0], buf[1]]
    rows = []
    for p in parts:
        if layout == "layer_first":
            rows.append(p[:, slot])
        elif layout == "page_first":
            rows.append(p[slot])
        else:
            rows.append(p[page, :, off])
    return torch.cat([r.flatten(1) for r in rows], dim=1)


def test_layers_allocated_apart_are_not_one_view() -> None:
    """A device pool allocated layer by layer (SGLang's ``MHATokenToKVPool`` on the CPU) is
    moved by the indexed path."""
    layers = [
        (torch.zeros(SLOTS, HEADS, DIM), torch.zeros(SLOTS, HEADS, DIM)) for _ in range(LAYERS)
    ]
    assert token_rows(layers, "token", PAGE) is None
