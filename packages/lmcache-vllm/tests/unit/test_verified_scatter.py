# SPDX-License-Identifier: Apache-2.0
"""Device checksums of ``VLLMPagedConnector``'s fused path, against the reference.

A store returns each chunk's ``lmcache-mix64-sum``, equal to :func:`lmcache.gpu_ops.
chunk_checksum` of the host bytes. A load of chunks that carry sums scatters only the chunks
that match: a corrupted chunk's slots keep their poison, the others equal the per-layer
reference path bit for bit. Layer by layer, the sums of the layers moved add up to the chunk's
sum. On CUDA the component is the connector's own; on the CPU it is attached for the test (a
CPU engine hashes on the host instead), so the same checks run in CI.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmcache.gpu_connector import ChunkTransfer, TransferSpec
from lmcache.gpu_ops import chunk_checksum
from lmcache_vllm.transfer.fused.kernels import ChunkKernels
from lmcache_vllm.transfer.fused.store import FusedStore
from lmcache_vllm.transfer.fused.transfer import FusedTransfer
from lmcache_vllm.transfer.fused.views import FusedViews
from lmcache_vllm.transfer.token_transfer import TokenTransfer

from .test_gpu_connector_fastpath import BLOCK, DEVICES, NUM_BLOCKS, _caches, _conn, _md

RANGES = [(0, 8), (8, 16), (16, 24), (24, 29)]


def _checked_conn(kind: str, device: str, seed: int):
    md = _md(kind)
    conn = _conn(kind, md, _caches(kind, md, device, seed), fused=True)
    fused = conn.transfer
    assert isinstance(fused, FusedTransfer)
    if fused.kernels is None:  # CPU: give it the kernels the CUDA connector builds itself
        kernels = ChunkKernels(conn.cache, conn.backend)
        on = fused.store.checksums
        conn.transfer = FusedTransfer(conn.cache, conn.backend, on, kernels=kernels)
    return md, conn


def chunk_buffers(conn, ranges, layout: str) -> list[ChunkTransfer]:
    """Zeroed host chunks; ``scattered``: each in its own allocation, else one storage."""
    if layout == "scattered":
        bufs = [torch.zeros(conn.chunk_shape(e - s), dtype=conn.dtype) for s, e in ranges]
    else:
        flat = torch.zeros(sum(conn.chunk_nbytes(e - s) for s, e in ranges), dtype=torch.uint8)
        bufs, at = [], 0
        for s, e in ranges:
            nb = conn.chunk_nbytes(e - s)
            bufs.append(flat[at : at + nb].view(conn.dtype).view(conn.chunk_shape(e - s)))
            at += nb
    return [ChunkTransfer(s, e, b) for (s, e), b in zip(ranges, bufs, strict=True)]


def _stored(conn, chunks: list[ChunkTransfer], slots) -> list[ChunkTransfer]:
    """Store ``chunks`` from ``conn`` (their buffers receive the bytes) and return them carrying
    the sums the store computed."""
    sums = conn.from_gpu(chunks, TransferSpec(slots))
    conn.synchronize()
    assert sums is not None
    return [dataclasses.replace(c, checksum=v) for c, v in zip(chunks, sums.values(), strict=True)]


def _slots(n: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm((NUM_BLOCKS - 1) * BLOCK, generator=g)[:n] + BLOCK).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["lbnhc", "lbhnc", "uneven", "mla"])
@pytest.mark.parametrize("skip", [0, 3, 9])
@pytest.mark.parametrize("store", ["kernel", "torch"])
def test_store_sums_and_verified_load(kind, device, skip, store, monkeypatch) -> None:
    """Stores through the gather kernel (one launch, sums in the same pass; on the CPU its
    reference) or the strided torch gather plus a sum pass give the same bytes and sums."""
    monkeypatch.setattr(FusedStore, "kernel_gather", store == "kernel")
    if store == "kernel" and device == "cpu":
        monkeypatch.setattr(FusedStore, "_by_kernel", lambda self, transfer: True)
    md, src = _checked_conn(kind, device, 1)
    n = RANGES[-1][1]
    slots = _slots(n, 2, "cpu")
    chunks = chunk_buffers(src, RANGES, "adjacent")
    chunks = _stored(src, chunks, slots)
    assert [c.checksum for c in chunks] == [chunk_checksum(c.buffer) for c in chunks]

    chunks[1].buffer.reshape(-1).view(torch.uint8)[7] ^= 0x20  # one bit of chunk 1
    _, dst = _checked_conn(kind, device, 3)
    _, ref = _checked_conn(kind, device, 3)  # same poison: the reference loads good chunks
    ref.transfer = TokenTransfer(ref.cache, ref.backend, ref.device)
    out = _slots(n, 4, "cpu")
    spec = TransferSpec(out, skip_tokens=skip)
    checks = dst.to_gpu(chunks, spec)
    dst.synchronize()
    assert checks is not None and checks.verified
    staged = [i for i, c in enumerate(chunks) if c.end > skip]
    assert checks.chunks == staged
    assert checks.ok() == [i != 1 for i in staged]
    good = [c for i, c in enumerate(chunks) if i != 1]
    ref.to_gpu(good, spec)
    ref.synchronize()
    for layer in range(md.num_layers):  # bad chunk's slots keep the poison, like ref's
        assert torch.equal(_bits(dst.cache.caches[layer]), _bits(ref.cache.caches[layer]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("skip", [0, 10])
def test_verified_load_of_chunks_with_a_gap(device: str, skip: int) -> None:
    """Chunks that are not consecutive in the request (chunk 1 left out): each lands on its
    own tokens' slots, and only the corrupted one is refused."""
    md, src = _checked_conn("lbnhc", device, 19)
    n = RANGES[-1][1]
    chunks = chunk_buffers(src, RANGES, "scattered")
    chunks = _stored(src, chunks, _slots(n, 20, "cpu"))
    chunks[2].buffer.reshape(-1).view(torch.uint8)[5] ^= 0x04
    picked = [chunks[0], chunks[2], chunks[3]]
    _, dst = _checked_conn("lbnhc", device, 21)
    _, ref = _checked_conn("lbnhc", device, 21)
    ref.transfer = TokenTransfer(ref.cache, ref.backend, ref.device)
    spec = TransferSpec(_slots(n, 22, "cpu"), skip_tokens=skip)
    checks = dst.to_gpu(picked, spec)
    dst.synchronize()
    assert checks is not None and checks.verified
    staged = [i for i, c in enumerate(picked) if c.end > skip]
    assert checks.chunks == staged
    assert checks.ok() == [i != 1 for i in staged]
    ref.to_gpu([picked[0], picked[2]], spec)
    ref.synchronize()
    for layer in range(md.num_layers):
        assert torch.equal(_bits(dst.cache.caches[layer]), _bits(ref.cache.caches[layer]))


def _on_stand_in_streams(conn):
    """Give ``conn``'s fused path a recording stand-in of a CUDA backend (streams and events;
    copies run at once on the CPU tensors) and the checksum component such a device gets."""
    from lmcache.testing.recording_backend import RecordingBackend

    rec = RecordingBackend("cuda")
    conn.backend = rec
    on = conn.transfer.store.checksums
    conn.transfer = FusedTransfer(conn.cache, rec, on, kernels=ChunkKernels(conn.cache, rec))
    return rec


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["lbnhc", "mla"])
@pytest.mark.parametrize("skip", [0, 9])
def test_kernel_pieces_move_what_one_piece_moves(
    device: str, kind: str, skip: int, monkeypatch
) -> None:
    """A kernel store and a verified load cut into pieces of whole chunks (one piece's DMAs
    overlapping the next piece's kernels) store the same bytes and sums, and load the same
    bytes and verdicts, as in one piece. On the CPU through a stand-in backend with streams."""
    monkeypatch.setattr(FusedStore, "_by_kernel", lambda self, transfer: True)
    monkeypatch.setattr(FusedViews, "min_piece_bytes", 1)
    calls: list[str] = []
    for name in ("_gather_and_copy_pieces",):
        real = getattr(FusedStore, name)
        monkeypatch.setattr(
            FusedStore, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k)
        )
    real_pieces = ChunkKernels.verified_scatter_pieces
    monkeypatch.setattr(
        ChunkKernels,
        "verified_scatter_pieces",
        lambda *a, **k: calls.append("verified_scatter_pieces") or real_pieces(*a, **k),
    )
    n = RANGES[-1][1]
    got = []
    for pieces in (1, 4):
        monkeypatch.setattr(FusedViews, "kernel_pieces", pieces)
        _, src = _checked_conn(kind, device, 31)
        if device == "cpu":
            _on_stand_in_streams(src)
        chunks = chunk_buffers(src, RANGES, "scattered")
        chunks = _stored(src, chunks, _slots(n, 32, "cpu"))
        chunks[2].buffer.reshape(-1).view(torch.uint8)[9] ^= 0x10
        _, dst = _checked_conn(kind, device, 33)
        if device == "cpu":
            _on_stand_in_streams(dst)
        checks = dst.to_gpu(chunks, TransferSpec(_slots(n, 34, "cpu"), skip_tokens=skip))
        dst.synchronize()
        assert checks is not None
        got.append(
            (
                [c.checksum for c in chunks],
                [_bits(c.buffer) for c in chunks],
                checks.chunks,
                checks.ok(),
                [_bits(t) for t in dst.cache.caches],
            )
        )
        assert calls == (
            [] if pieces == 1 else ["_gather_and_copy_pieces", "verified_scatter_pieces"]
        )
        calls.clear()
    (s1, b1, c1, ok1, p1), (s4, b4, c4, ok4, p4) = got
    assert s1 == s4 and c1 == c4 and ok1 == ok4 == [i != 2 for i in c1]
    assert all(torch.equal(x, y) for x, y in zip(b1 + p1, b4 + p4, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["lbnhc", "lbhnc", "mla"])
def test_layerwise_store_sums_add_up(kind: str, device: str, monkeypatch) -> None:
    """A store layer by layer through the gather kernel returns each layer's sums: over all
    layers they add up to each chunk's checksum, and the bytes are those of an all-layer store."""
    monkeypatch.setattr(FusedStore, "_by_kernel", lambda self, transfer: True)
    n = RANGES[-1][1]
    slots = _slots(n, 40, "cpu")
    md, conn = _checked_conn(kind, device, 41)
    whole = chunk_buffers(conn, RANGES, "adjacent")
    conn.from_gpu(whole, TransferSpec(slots))
    conn.synchronize()
    chunks = chunk_buffers(conn, RANGES, "scattered")
    total = [0] * len(chunks)
    for layer in range(md.num_layers):
        sums = conn.from_gpu_layer(layer, chunks, TransferSpec(slots))
        conn.synchronize()
        assert sums is not None
        total = [(t + v) % (1 << 64) for t, v in zip(total, sums.values(), strict=True)]
    assert total == [chunk_checksum(c.buffer) for c in chunks]
    for a, b in zip(chunks, whole, strict=True):
        assert torch.equal(_bits(a.buffer), _bits(b.buffer))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["lbnhc", "mla"])
def test_layerwise_load_sums_add_up(kind: str, device: str) -> None:
    md, src = _checked_conn(kind, device, 5)
    slots = _slots(RANGES[-1][1], 6, "cpu")
    chunks = chunk_buffers(src, RANGES, "scattered")
    chunks = _stored(src, chunks, slots)
    chunks[2].buffer.reshape(-1).view(torch.uint8)[3] ^= 0x01
    _, dst = _checked_conn(kind, device, 7)
    total = [0] * len(chunks)
    spec = TransferSpec(_slots(RANGES[-1][1], 8, "cpu"))
    for layer in range(md.num_layers):
        checks = dst.to_gpu_layer(layer, chunks, spec)
        dst.synchronize()
        assert (
            checks is not None and not checks.verified and checks.layers == range(layer, layer + 1)
        )
        for pos, value in zip(checks.chunks, checks.sums(), strict=True):
            total[pos] += value
    got = [t % (1 << 64) for t in total]
    assert got == [chunk_checksum(c.buffer) for c in chunks]
    assert [g == c.checksum for g, c in zip(got, chunks, strict=True)] == [True, True, False, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="prefetch needs a CUDA device (streams)")
def test_prefetched_load_is_verified_too() -> None:
    _, src = _checked_conn("lbnhc", "cuda", 9)
    slots = _slots(RANGES[-1][1], 10, "cpu")
    chunks = chunk_buffers(src, RANGES, "adjacent")
    chunks = _stored(src, chunks, slots)
    chunks[0].buffer.reshape(-1).view(torch.uint8)[11] ^= 0x80
    _, dst = _checked_conn("lbnhc", "cuda", 11)
    stream = dst.backend.new_stream(dst.device)
    staged = dst.prefetch(chunks, stream)
    assert staged is not None
    checks = dst.to_gpu(chunks, TransferSpec(_slots(RANGES[-1][1], 12, "cpu"), staged=staged))
    dst.synchronize()
    assert checks is not None and checks.ok() == [False, True, True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="prefetch needs a CUDA device (streams)")
@pytest.mark.parametrize("layers", ["all", "groups"])
def test_prefetched_copy_freed_without_a_collection(layers: str) -> None:
    """A device copy made at lookup dies with the last reference to its load, not at the next
    full garbage collection: until it does, it holds the prefetch budget, and the next hit
    would be copied twice (once to check it, once to load it)."""
    import gc
    import weakref

    _, src = _checked_conn("lbnhc", "cuda", 15)
    chunks = chunk_buffers(src, RANGES, "adjacent")
    chunks = _stored(src, chunks, _slots(RANGES[-1][1], 16, "cpu"))
    md, dst = _checked_conn("lbnhc", "cuda", 17)
    stream = dst.backend.new_stream(dst.device)
    gc.disable()
    try:
        staged = dst.prefetch(chunks, stream)
        assert staged is not None
        copy = weakref.ref(staged.staging)
        spec = TransferSpec(_slots(RANGES[-1][1], 18, "cpu"), staged=staged)
        if layers == "all":
            checks = dst.to_gpu(chunks, spec)
        else:
            checks = dst.to_gpu_layers(range(0, 1), chunks, spec)
            dst.to_gpu_layers(range(1, md.num_layers), chunks, spec)
        dst.synchronize()
        assert checks is not None
        del staged, spec, checks
        assert copy() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scratch", [1 << 30, 1])
@pytest.mark.parametrize("damage", ["flipped_bit", "other_chunk"])
def test_verify_chunks_before_a_load(device: str, scratch: int, damage: str) -> None:
    """A hit checked on the device right after its lookup: in place in a device copy, or
    through a scratch buffer (``scratch=1``: one chunk at a time)."""
    _, src = _checked_conn("lbnhc", device, 13)
    ranges = [(0, 8), (8, 16), (16, 24)]
    chunks = chunk_buffers(src, ranges, "scattered")
    chunks = _stored(src, chunks, _slots(24, 14, "cpu"))
    chunks.append(dataclasses.replace(chunks[0], start=24, end=32, checksum=None))  # no sum: ok
    fused = src.transfer
    fused.kernels.scratch_bytes = scratch
    stream = src.backend.new_stream(src.device) if device == "cuda" else None
    assert fused.verify_chunks(chunks[:3], stream, None) == [True, True, True]
    if damage == "flipped_bit":
        chunks[1].buffer.reshape(-1).view(torch.uint8)[9] ^= 0x02
    else:
        chunks[1].buffer.copy_(chunks[2].buffer)
    assert fused.verify_chunks(chunks, stream, None) == [True, False, True, True]
    if device == "cuda":  # in place, in a prefetch's device copy
        pre = src.prefetch(chunks[:3], stream)
        assert pre is not None
        assert fused.verify_chunks(chunks[:3], stream, pre) == [True, False, True]


@pytest.mark.parametrize("device", DEVICES)
def test_a_slot_outside_the_cache_is_refused(device: str, monkeypatch) -> None:
    """The kernels skip slots outside the cache; the index is checked on the host first."""
    if device == "cpu":
        monkeypatch.setattr(FusedStore, "_by_kernel", lambda self, transfer: True)
    _, conn = _checked_conn("lbnhc", device, 15)
    chunks = chunk_buffers(conn, [(0, 8)], "scattered")
    slots = _slots(8, 16, "cpu")
    slots[5] = NUM_BLOCKS * BLOCK  # one past the last slot
    with pytest.raises(ValueError, match="is beyond the cache"):
        conn.from_gpu(chunks, TransferSpec(slots))
    good = _slots(8, 16, "cpu")
    sums = conn.from_gpu(chunks, TransferSpec(good))
    conn.synchronize()
    assert sums is not None
    stored = [dataclasses.replace(chunks[0], checksum=sums.values()[0])]
    with pytest.raises(ValueError, match="is beyond the cache"):
        conn.to_gpu(stored, TransferSpec(slots))


@pytest.mark.parametrize("device", DEVICES)
def test_a_prepared_kernel_store_matches_an_unprepared_one(device: str, monkeypatch) -> None:
    """The kernel store planned ahead (index uploaded before the KV exists) copies the same
    bytes and sums as one planned at the copy."""
    if device == "cpu":
        monkeypatch.setattr(FusedStore, "_by_kernel", lambda self, transfer: True)
        monkeypatch.setattr(FusedStore, "plans_ahead", lambda self, transfer: True)
    _, conn = _checked_conn("lbnhc", device, 17)
    slots = _slots(RANGES[-1][1], 18, "cpu")
    spec = TransferSpec(slots)
    a = chunk_buffers(conn, RANGES, "adjacent")
    b = chunk_buffers(conn, RANGES, "adjacent")
    prep = conn.prepare_store(a, spec)
    assert prep is not None and prep.kernel_index is not None
    sums_a = conn.from_gpu(a, dataclasses.replace(spec, prepared=prep))
    sums_b = conn.from_gpu(b, spec)
    conn.synchronize()
    assert sums_a is not None and sums_b is not None
    assert sums_a.values() == sums_b.values() == [chunk_checksum(c.buffer) for c in b]
    assert all(torch.equal(_bits(x.buffer), _bits(y.buffer)) for x, y in zip(a, b, strict=True))
