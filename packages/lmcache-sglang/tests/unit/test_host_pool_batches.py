# SPDX-License-Identifier: Apache-2.0
"""Pages of a HiCache host pool in any order move with one indexed copy per batch of buffers.

:mod:`lmcache_sglang.host_pool_batches` views the pool as ``[pages, layers, ...]`` and the
chunk buffers ``allocate_many`` carves back to back as one tensor: a store is one indexed
gather, a load one ``index_copy_``. Every case runs the same transfer through that
path, through the per-run path (the batched one switched off) and by hand, bit for bit (random
bits, NaN patterns included), in each host layout, MHA and MLA, both directions: pages in random
order, a load cut by ``skip_tokens``, single layers, buffers with a gap between them (an aligned
allocation), two allocations. The batched path must be the one taken (the per-run path raises,
torch calls are counted), and the cases it leaves fall back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import lmcache_sglang.gpu_connector as gpu_connector
import lmcache_sglang.host_pool_batches as host_pool_batches
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache_sglang.gpu_connector import SGLangKVConnector
from lmcache_sglang.host_pool_batches import PageBatches, page_batches

from . import test_host_pool_runs as host_pool_runs

LAYERS, PAGES, PAGE, HEADS, DIM, LATENT = 3, 24, 4, 2, 8, 24
SLOTS = PAGES * PAGE
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _bits(*shape: int, seed: int) -> torch.Tensor:
    """bf16 of random bits: NaN payloads too, so every byte must be copied, never computed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(
        torch.bfloat16
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _pool(layout: str, mla: bool) -> torch.Tensor:
    tail = (1, LATENT) if mla else (HEADS, DIM)
    dims = {
        "layer_first": (LAYERS, SLOTS, *tail),
        "page_first": (SLOTS, LAYERS, *tail),
        "page_first_direct": (PAGES, LAYERS, PAGE, *tail),
    }[layout]
    return _bits(*(dims if mla else (2, *dims)), seed=1)


def _connector(buf: torch.Tensor, layout: str, mla: bool) -> SGLangKVConnector:
    conn = host_pool_runs._connector(buf, layout, mla)  # the same geometry but PAGES
    assert conn.rows is not None
    return conn


def _chunks(
    conn: SGLangKVConnector, count: int, size: int, seed: int, gap: int = 0, split: int = 0
) -> list[ChunkTransfer]:
    """``count`` chunks of ``size`` tokens whose buffers lie back to back in one allocation
    (``gap`` elements apart, as an aligned ``allocate_many`` leaves them), or in two from chunk
    ``split`` on."""
    shape = conn.chunk_shape(size)
    numel = shape[0] * shape[1] * shape[2]
    bufs = []
    for n in (split, count - split) if split else (count,):
        whole = _bits(n, numel + gap, seed=seed + n)
        bufs += [row[:numel].view(shape) for row in whole.unbind(0)]
    return [ChunkTransfer(i * size, (i + 1) * size, b) for i, b in enumerate(bufs)]


def _slots(pages: list[int], size: int = PAGE) -> torch.Tensor:
    return torch.cat([torch.arange(p * size, (p + 1) * size) for p in pages])


def _token(kv: torch.Tensor, layout: str, mla: bool, layer: int, slot: int) -> list[torch.Tensor]:
    """``[heads, dim]`` views of one token of one layer per part (K, V; the latent), found by
    hand."""
    parts = [kv] if mla else [kv[0], kv[1]]
    if layout == "layer_first":
        return [p[layer, slot] for p in parts]
    if layout == "page_first":
        return [p[slot, layer] for p in parts]
    return [p[slot // PAGE, layer, slot % PAGE] for p in parts]


def _by_hand_store(
    kv: torch.Tensor,
    layout: str,
    mla: bool,
    chunks: list[ChunkTransfer],
    slots: torch.Tensor,
    layers: range,
) -> list[torch.Tensor]:
    """What each chunk's buffer holds after a store, read from the pool token by token."""
    out = []
    for c in chunks:
        want = c.buffer.clone()
        for layer in layers:
            for t in range(c.start, c.end):
                views = _token(kv, layout, mla, layer, int(slots[t]))
                want[layer, t - c.start] = torch.cat([v.flatten() for v in views])
        out.append(want)
    return out


def _by_hand_load(
    kv: torch.Tensor,
    layout: str,
    mla: bool,
    chunks: list[ChunkTransfer],
    slots: torch.Tensor,
    layers: range,
    skip: int,
) -> None:
    """A load written into the pool token by token."""
    for c in chunks:
        for layer in layers:
            for t in range(max(c.start, skip), c.end):
                row = c.buffer[layer, t - c.start]
                for i, view in enumerate(_token(kv, layout, mla, layer, int(slots[t]))):
                    view.copy_(row[i * view.numel() : (i + 1) * view.numel()].view(view.shape))


@contextmanager
def _batched_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """The per-run path raises; counts gathers, ``index_copy_`` and ``copy_`` calls."""
    calls = {"gather": 0, "index_copy_": 0, "copy_": 0}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            calls[name] += 1
            return fn(*a, **kw)

        return wrapper

    def no_runs(*_: object) -> None:
        raise AssertionError("the per-run path was taken")

    with monkeypatch.context() as m:
        m.setattr(SGLangKVConnector, "_runs", no_runs)
        m.setattr(host_pool_batches, "_gather", counted("gather", host_pool_batches._gather))
        m.setattr(torch.Tensor, "index_copy_", counted("index_copy_", torch.Tensor.index_copy_))
        m.setattr(torch.Tensor, "copy_", counted("copy_", torch.Tensor.copy_))
        yield calls


def _per_run_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_connector, "page_batches", lambda *_: None)


CASES = {
    # name: (pages in slot order, chunk buffers: gap, split; load skip_tokens, batches)
    "random pages": (None, 0, 0, 0, 1),
    "reversed pages": (list(range(15, 5, -1)), 0, 0, 0, 1),
    "aligned gap": (None, 16, 0, 0, 1),
    "odd gap": (None, 1, 0, 0, 1),  # read as bf16: no wider element divides the spacing
    "two allocations": (None, 0, 4, 0, 2),
    "skip a page and a half": (None, 0, 0, PAGE + PAGE // 2, 1),
}


def _pages(case: str) -> list[int]:
    pages = CASES[case][0]
    if pages is None:
        g = torch.Generator().manual_seed(len(case))
        pages = torch.randperm(PAGES, generator=g)[:10].tolist()
    return pages


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_batches_match_per_run_path_and_by_hand(
    layout: str, mla: bool, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, gap, split, skip, batches = CASES[case]
    pages = _pages(case)
    slots = _slots(pages)
    kv = _pool(layout, mla)
    fast_kv, slow_kv, hand_kv = kv.clone(), kv.clone(), kv.clone()
    fast, slow = _connector(fast_kv, layout, mla), _connector(slow_kv, layout, mla)
    count = len(pages)
    for layers in (range(LAYERS), range(1, 2)):
        spec = TransferSpec(slots)
        a = _chunks(fast, count, PAGE, 7, gap, split)
        b = _chunks(slow, count, PAGE, 7, gap, split)
        want = _by_hand_store(fast_kv, layout, mla, a, slots, layers)
        with _batched_only(monkeypatch) as calls:
            if len(layers) == LAYERS:
                fast.from_gpu(a, spec)
            else:
                fast.from_gpu_layer(layers.start, a, spec)
        assert calls == {"gather": batches, "index_copy_": 0, "copy_": 0}
        with monkeypatch.context() as m:
            _per_run_only(m)
            if len(layers) == LAYERS:
                slow.from_gpu(b, spec)
            else:
                slow.from_gpu_layer(layers.start, b, spec)
        for x, y, w in zip(a, b, want, strict=True):
            assert _same(x.buffer, y.buffer) and _same(x.buffer, w)

        spec = TransferSpec(slots, skip_tokens=skip)
        chunks = _chunks(fast, count, PAGE, 11, gap, split)
        with _batched_only(monkeypatch) as calls:
            fast.to_gpu_layers(layers, chunks, spec)
        cut = 1 if skip % PAGE else 0  # the chunk ``skip`` cuts: one strided copy
        assert calls == {"gather": 0, "index_copy_": batches, "copy_": cut}
        with monkeypatch.context() as m:
            _per_run_only(m)
            slow.to_gpu_layers(layers, chunks, spec)
        _by_hand_load(hand_kv, layout, mla, chunks, slots, layers, skip)
        assert _same(fast_kv, slow_kv) and _same(fast_kv, hand_kv)
        assert not _same(fast_kv, kv)


def _plan(
    conn: SGLangKVConnector, slots: torch.Tensor, chunks: list[ChunkTransfer], skip: int = 0
) -> PageBatches | None:
    spans = conn._spans(chunks, TransferSpec(slots, skip_tokens=skip), skip)
    return page_batches(conn.rows, range(LAYERS), spans, conn.num_slots)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_what_falls_back(layout: str) -> None:
    """Cases the per-run or indexed path keeps: one run of slots, buffers apart, one page
    twice, a slot outside the pool, a partial chunk that is not the first moved, and in
    ``page_first_direct`` chunks of two pages (not one page: units are not evenly spaced)."""
    conn = _connector(_pool(layout, False), layout, False)
    shuffled = _slots([5, 2, 9, 4])
    plan = _plan(conn, shuffled, _chunks(conn, 4, PAGE, 0))
    assert plan is not None and len(plan.batches) == 1
    assert plan.batches[0][0].dtype == torch.complex128  # 16 bytes a step (a head of 8 bf16)
    assert _plan(conn, _slots([4, 5, 6, 7]), _chunks(conn, 4, PAGE, 0)) is None
    apart = [ChunkTransfer(c.start, c.end, c.buffer.clone()) for c in _chunks(conn, 4, PAGE, 0)]
    assert _plan(conn, shuffled, apart) is None
    assert _plan(conn, _slots([5, 2, 5, 4]), _chunks(conn, 4, PAGE, 0)) is None
    outside = shuffled.clone()
    outside[-1] = SLOTS
    assert _plan(conn, outside, _chunks(conn, 4, PAGE, 0)) is None
    assert _plan(conn, shuffled + 1, _chunks(conn, 4, PAGE, 0)) is None  # pages cut in two
    two = _plan(conn, _slots([4, 1, 8], 2 * PAGE), _chunks(conn, 3, 2 * PAGE, 0))
    assert (two is None) == (layout == "page_first_direct")
    # a load cut by skip inside the first chunk is batched; one copy moves that chunk's tail
    cut = _plan(conn, shuffled, _chunks(conn, 4, PAGE, 0), skip=1)
    assert cut is not None and len(cut.pairs) == 1 and len(cut.batches) == 1


def test_store_with_a_page_twice_falls_back_to_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One page stored into two chunks: the per-run path moves it, as before."""
    kv = _pool("page_first", False)
    conn = _connector(kv, "page_first", False)
    slots = _slots([3, 7, 3])
    chunks = _chunks(conn, 3, PAGE, 0)
    conn.from_gpu(chunks, TransferSpec(slots))
    assert _same(chunks[0].buffer, chunks[2].buffer)
    want = _by_hand_store(kv, "page_first", False, chunks, slots, range(LAYERS))
    assert all(_same(c.buffer, w) for c, w in zip(chunks, want, strict=True))
