# SPDX-License-Identifier: Apache-2.0
"""The ``cpu_kt_v`` block path of ``VLLMPagedConnector`` against its token-level path, bit for bit.

The block path (whole blocks straight between the cache and the chunk buffers, all layers per op
when they share a buffer, token-level for the rest) is taken for ``cpu_kt_v`` caches on CPU; the
per-layer token path through a staging buffer is the reference.
"""

from __future__ import annotations

import pytest
import torch

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import ChunkTransfer, EngineInfo, TransferSpec
from lmcache.memory.pinned_pool import ALIGNMENT
from lmcache.metadata import LMCacheMetadata
from lmcache_vllm.gpu_connector import VLLMPagedConnector
from lmcache_vllm.testing.chunk_buffers import chunk_buffers as _buffers
from lmcache_vllm.transfer.cpu_block_transfer import CpuBlockTransfer
from lmcache_vllm.transfer.token_transfer import TokenTransfer

BLOCK, NUM_BLOCKS, LAYERS, HEADS, HEAD, CHUNK = 4, 40, 3, 2, 8, 8
N = 29  # tokens of the request


def _md(dtype: torch.dtype = torch.bfloat16) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="ktv", world_size=1, worker_id=0, local_worker_id=0, local_world_size=1,
        num_layers=LAYERS, chunk_size=CHUNK, kv_dtype=dtype, num_kv_heads=HEADS,
        head_size_k=HEAD, head_size_v=HEAD,
    )  # fmt: skip


def _caches(layout: str, seed: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Per-layer ``[blocks, heads, block, 2 * head]`` views, physically K^T then V per
    ``(block, head)``: ``one`` buffer (vLLM), ``gapped`` (one buffer, unused blocks between
    layers), ``odd`` (one buffer, a step that is not a whole number of blocks), ``separate``."""
    g = torch.Generator().manual_seed(seed)
    run = 2 * BLOCK * HEAD
    layer = NUM_BLOCKS * HEADS * run
    if layout in ("one", "separate"):
        phys = torch.randn(LAYERS, NUM_BLOCKS, HEADS, run, generator=g).to(dtype)
        views = [phys[i].view(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) for i in range(LAYERS)]
        return [v.clone() for v in views] if layout == "separate" else views
    pad = 3 * HEADS * run if layout == "gapped" else 5
    flat = torch.randn(LAYERS * (layer + pad), generator=g).to(dtype)
    return [
        flat[i * (layer + pad) : i * (layer + pad) + layer].view(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
        for i in range(LAYERS)
    ]


def _conn(caches: list[torch.Tensor], blocks: bool = True) -> VLLMPagedConnector:
    conn = VLLMPagedConnector(
        LMCacheConfig(chunk_size=CHUNK),
        _md(caches[0].dtype),
        EngineInfo("vllm", "cpu", caches, {"block_size": BLOCK}),
        {"kv_format": "cpu_kt_v"},
    )
    assert isinstance(conn.transfer, CpuBlockTransfer)
    if not blocks:  # the per-layer token path: the reference
        conn.transfer = TokenTransfer(conn.cache, conn.backend, conn.device)
    return conn


def _slots(kind: str, seed: int) -> torch.Tensor:
    """Slot mapping of ``N`` tokens: ``aligned`` (vLLM: token t in block table[t // BLOCK] at
    offset t % BLOCK), ``mid`` (the request starts mid-block), ``shuffled`` (aligned, but one
    block's tokens out of order), ``random`` (no whole blocks)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(NUM_BLOCKS - 1, generator=g)[: N // BLOCK + 2] + 1
    t = torch.arange(N)
    if kind == "random":
        return torch.randperm((NUM_BLOCKS - 1) * BLOCK, generator=g)[:N] + BLOCK
    if kind == "mid":
        t = t + 2
    slots = table[t // BLOCK] * BLOCK + t % BLOCK
    if kind == "shuffled":
        slots[8:12] = slots[8:12].flip(0)
    return slots


RANGES = {
    "chunks": [(0, 8), (8, 16), (16, 24), (24, 29)],  # partial last block
    "gapped": [(0, 8), (16, 24), (24, 29)],
    "mid": [(2, 10), (10, 18), (18, 27)],  # chunk boundaries mid-block
}


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _chunks(rng, bufs):
    return [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, bufs, strict=True)]


@pytest.mark.parametrize("cache_layout", ["one", "gapped", "odd", "separate"])
@pytest.mark.parametrize("slots_kind", ["aligned", "mid", "shuffled", "random"])
@pytest.mark.parametrize("ranges", list(RANGES))
@pytest.mark.parametrize("buf_layout", ["adjacent", "scattered", "strided"])
def test_block_path_matches_token_path(cache_layout, slots_kind, ranges, buf_layout):
    rng = RANGES[ranges]
    src = _caches(cache_layout, 1)
    fast, ref = _conn(src), _conn(src, blocks=False)
    slots = _slots(slots_kind, 2)
    with _buffers(fast, rng, buf_layout) as a, _buffers(fast, rng, buf_layout) as b:
        fast.from_gpu(_chunks(rng, a), TransferSpec(slots))
        ref.from_gpu(_chunks(rng, b), TransferSpec(slots))
        for x, y in zip(a, b, strict=True):
            assert _eq(x, y)
        # skip: none, mid-block, block-aligned, mid-block of a later chunk, everything
        for skip in (0, 3, 4, rng[1][0] + 1, N):
            d1, d2 = _caches(cache_layout, 3), _caches(cache_layout, 3)
            c1, c2 = _conn(d1), _conn(d2, blocks=False)
            lslots = _slots(slots_kind, 4)
            lslots[:skip] = -1  # held by the engine: never read
            spec = TransferSpec(lslots, skip_tokens=skip)
            c1.to_gpu(_chunks(rng, a), spec)
            c2.to_gpu(_chunks(rng, a), spec)
            for x, y in zip(d1, d2, strict=True):
                assert _eq(x, y)
            if skip == N:
                for x, y in zip(d1, _caches(cache_layout, 3), strict=True):
                    assert _eq(x, y)


@pytest.mark.parametrize("cache_layout", ["one", "odd", "separate"])
def test_layerwise_matches_batched(cache_layout):
    rng = RANGES["chunks"]
    src = _caches(cache_layout, 5)
    conn = _conn(src)
    slots = _slots("mid", 6)
    with _buffers(conn, rng, "adjacent") as a, _buffers(conn, rng, "adjacent") as b:
        conn.from_gpu(_chunks(rng, a), TransferSpec(slots))
        for layer in range(LAYERS):
            conn.from_gpu_layer(layer, _chunks(rng, b), TransferSpec(slots))
        for x, y in zip(a, b, strict=True):
            assert _eq(x, y)
        d1, d2 = _caches(cache_layout, 7), _caches(cache_layout, 7)
        c1, c2 = _conn(d1), _conn(d2)
        spec = TransferSpec(_slots("aligned", 8), skip_tokens=5)
        c1.to_gpu(_chunks(rng, a), spec)
        for layer in range(LAYERS):
            c2.to_gpu_layer(layer, _chunks(rng, b), spec)
        for x, y in zip(d1, d2, strict=True):
            assert _eq(x, y)


def test_block_path_against_physical_layout():
    """Independent oracle: token t of layer l, head h is K = phys[l, b, h, :, o] (K^T) and
    V = phys[l, b, h, o, :] (after the K^T half), with float32 (odd sizes do not widen)."""
    caches = _caches("one", 9, torch.float32)
    conn = _conn(caches)
    slots = _slots("mid", 10)
    rng = RANGES["chunks"]
    with _buffers(conn, rng, "adjacent") as bufs:
        conn.from_gpu(_chunks(rng, bufs), TransferSpec(slots))
        got = torch.cat(bufs, dim=1)
    phys = torch.stack(caches).flatten(3)  # [L, B, H, 2 * BLOCK * HEAD]
    kt = phys[..., : BLOCK * HEAD].unflatten(-1, (HEAD, BLOCK))
    vv = phys[..., BLOCK * HEAD :].unflatten(-1, (BLOCK, HEAD))
    b, o = slots // BLOCK, slots % BLOCK
    k = kt[:, b, :, :, o]  # advanced indices split by slices go first: [N, L, H, HEAD]
    v = vv[:, b, :, o, :]
    want = torch.cat((k.flatten(2), v.flatten(2)), dim=2).transpose(0, 1)
    assert torch.equal(got, want)


def test_plan_groups_whole_chunks_and_leaves_edges_to_the_token_path():
    conn = _conn(_caches("one", 11))
    rng = [(0, 8), (8, 16), (16, 24), (24, 29)]
    with _buffers(conn, rng, "adjacent") as bufs:
        chunks = _chunks(rng, bufs)
        groups, edges = conn.transfer._kt_v_plan(chunks, TransferSpec(_slots("aligned", 12)), 0)
        if conn.chunk_nbytes(CHUNK) % ALIGNMENT == 0:  # back to back in the slab: one group
            assert [g.count for g in groups] == [3, 1]
        assert [g.blocks.shape for g in groups][-1] == (1, 1)  # the tail's one whole block
        assert [p.tolist() for _, p in edges.parts] == [[4]]  # token 28: a partial block
        # skip mid-block: the first chunk's block 0 is partly held -> its 1 token goes alone
        groups, edges = conn.transfer._kt_v_plan(chunks, TransferSpec(_slots("aligned", 12)), 3)
        assert groups[0].t0 == 4 and groups[0].blocks.shape == (1, 1)
        assert [p.tolist() for _, p in edges.parts] == [[3], [4]]
        # a request starting mid-block: no chunk-aligned whole blocks in the first chunk
        groups, edges = conn.transfer._kt_v_plan(chunks, TransferSpec(_slots("mid", 12)), 0)
        assert groups[0].t0 == 2 and edges.parts[0][1].tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS * BLOCK])
def test_bad_slot_rejected_before_any_write(bad):
    caches = _caches("one", 13)
    conn = _conn(caches)
    before = [c.clone() for c in caches]
    rng = RANGES["chunks"]
    slots = _slots("aligned", 14)
    slots[20] = bad
    # the connector's own check names the bad entry (not some later indexing error)
    why = r"-1 for tokens \[20\]" if bad < 0 else rf"slot {bad} is beyond the cache"
    with _buffers(conn, rng, "adjacent") as a:
        with pytest.raises(ValueError, match=why):
            conn.from_gpu(_chunks(rng, a), TransferSpec(slots))
        with pytest.raises(ValueError, match=why):
            conn.to_gpu(_chunks(rng, a), TransferSpec(slots, skip_tokens=3))
        for x, y in zip(caches, before, strict=True):
            assert _eq(x, y)
        # skipping past the bad slot: loads tokens 21.. like the token-level reference path
        for t in a:
            t.copy_(torch.randn(t.shape).to(t.dtype))
        conn.to_gpu(_chunks(rng, a), TransferSpec(slots, skip_tokens=21))
        ref = _caches("one", 13)
        _conn(ref, blocks=False).to_gpu(_chunks(rng, a), TransferSpec(slots, skip_tokens=21))
        assert not all(_eq(x, y) for x, y in zip(caches, before, strict=True))
        for x, y in zip(caches, ref, strict=True):
            assert _eq(x, y)


@pytest.mark.parametrize(
    ("cache_layout", "sources"), [("one", 1), ("gapped", 1), ("odd", 3), ("separate", 3)]
)
def test_layers_share_one_op_when_they_share_a_buffer(cache_layout, sources):
    conn = _conn(_caches(cache_layout, 15))
    assert len(conn.transfer._kt_v_sources) == sources
    widened = [s.vw is not None for s in conn.transfer._kt_v_sources]  # V rows as 16-byte elements
    # odd: layers 1 and 2 start at 2-byte offsets, so only layer 0's V widens
    assert widened == ([True, False, False] if cache_layout == "odd" else [True] * sources)
