# SPDX-License-Identifier: Apache-2.0
"""Device checksums of ``SGLangKVConnector``'s kernel path, against the reference.

A store returns each chunk's ``lmcache-mix64-sum``, equal to :func:`lmcache.gpu_ops.
chunk_checksum` of the host bytes, and copies the same bytes as the torch path. A load of
chunks that carry sums writes only the chunks that match: a corrupted chunk's slots keep their
poison, and the pools equal those of the torch path loading the good chunks only, bit for bit.
Layer by layer, the sums of the layers moved add up to the chunk's sum. On CUDA the kernel path
is the connector's own; on the CPU it is attached for the test (a CPU engine hashes on the host
instead), where the ops run their pure-torch reference, so the same checks run in CI.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import ChunkTransfer, EngineInfo, TransferSpec
from lmcache.gpu_ops import chunk_checksum
from lmcache.metadata import LMCacheMetadata
from lmcache.tiers import CPUTier
from lmcache_sglang.gpu_connector import SGLangKVConnector

from . import test_gpu_connector_conformance as suite

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)
DEVICES = ["cpu", CUDA]
PAGE, PAGES, LAYERS = 4, 16, 3
SLOTS = PAGE * PAGES
RANGES = [(0, 8), (8, 16), (16, 24), (24, 29)]
FP8 = getattr(torch, "float8_e4m3fn", None)

# (pool kind, dtype, heads, head_k, head_v); "odd": rows of 12 bytes (not whole 64-bit words)
KINDS = {
    "mha": ("token", torch.bfloat16, 2, 8, 4),
    "hnd": ("paged_hnd", torch.float16, 2, 8, 8),
    "page_first": ("page_first", torch.bfloat16, 2, 4, 4),
    "paged_nhd": ("paged_nhd", torch.float32, 1, 4, 4),
    "mla": ("mla", torch.bfloat16, 1, 12, 0),
    "mha_fp8": ("token", FP8, 2, 8, 8),
    "mla_fp8": ("mla", FP8, 1, 24, 0),
    "odd": ("token", torch.float16, 1, 3, 3),
}


def _md(kind: str) -> LMCacheMetadata:
    _, dtype, heads, hk, hv = KINDS[kind]
    if dtype is None:
        pytest.skip("this torch has no float8_e4m3fn")
    return LMCacheMetadata(
        model_name="m",
        world_size=1,
        worker_id=0,
        local_worker_id=0,
        local_world_size=1,
        kv_dtype=dtype,
        num_layers=LAYERS,
        num_kv_heads=heads,
        head_size_k=hk,
        head_size_v=hv,
        use_mla=hv == 0,
        chunk_size=8,
    )


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bytes as ``dtype`` (every bit pattern, fp8 included)."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def _pools(kind: str, md: LMCacheMetadata, device: str, seed: int) -> tuple[EngineInfo, dict]:
    """SGLang's pools of ``kind`` (as :mod:`lmcache_sglang.kv_pools` reads them) on ``device``."""
    layout, dtype, heads, hk, hv = KINDS[kind]
    g = torch.Generator().manual_seed(seed)
    hints: dict = {"kv_layout": "token"}
    if layout == "mla":
        kv = _random((LAYERS, SLOTS, 1, hk), dtype, g).to(device)
        caches: list = [kv[i] for i in range(LAYERS)]
    elif layout == "token":
        k = _random((LAYERS, SLOTS, heads, hk), dtype, g).to(device)
        v = _random((LAYERS, SLOTS, heads, hv), dtype, g).to(device)
        caches = [(k[i], v[i]) for i in range(LAYERS)]
    elif layout == "page_first":  # HiCache host [2, slots, layers, H, D]: strided layer views
        buf = _random((2, SLOTS, LAYERS, heads, hk), dtype, g).to(device)
        caches = [(buf[0, :, i], buf[1, :, i]) for i in range(LAYERS)]
    elif layout == "paged_nhd":  # HiCache page_first_direct [2, pages, layers, ps, H, D]
        buf = _random((2, PAGES, LAYERS, PAGE, heads, hk), dtype, g).to(device)
        caches = [(buf[0, :, i], buf[1, :, i]) for i in range(LAYERS)]
        hints = {"kv_layout": "paged_nhd", "page_size": PAGE}
    else:  # paged HND device pool [pages, H, ps, D] per layer
        k = _random((LAYERS, PAGES, heads, PAGE, hk), dtype, g).to(device)
        v = _random((LAYERS, PAGES, heads, PAGE, hv), dtype, g).to(device)
        caches = [(k[i], v[i]) for i in range(LAYERS)]
        hints = {"kv_layout": "paged_hnd", "page_size": PAGE}
    return EngineInfo("sglang", device, caches), hints


def _conn(kind: str, device: str, seed: int, kernels: bool = True) -> SGLangKVConnector:
    """A connector over fresh pools; ``kernels``: with the kernel path (attached on the CPU),
    else the torch path (the reference)."""
    md = _md(kind)
    engine, hints = _pools(kind, md, device, seed)
    conn = SGLangKVConnector(LMCacheConfig(chunk_size=8), md, engine, hints)
    if not kernels:
        conn.kernels = None
    elif conn.kernels is None:
        assert device == "cpu", "a CUDA connector builds its kernel path itself"
        conn.kernels = conn.kernel_transfer()
        assert conn.kernels is not None
    assert conn.verifies_checksums == kernels
    return conn


def _chunks(conn: SGLangKVConnector, ranges=RANGES) -> list[ChunkTransfer]:
    return [
        ChunkTransfer(s, e, torch.zeros(conn.chunk_shape(e - s), dtype=conn.dtype))
        for s, e in ranges
    ]


def _slots(n: int, seed: int) -> torch.Tensor:
    """``n`` distinct slots of the pool, none in the padding page 0."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(SLOTS - PAGE, generator=g)[:n] + PAGE


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().clone().reshape(-1).view(torch.uint8)


def _read(conn: SGLangKVConnector, slots: torch.Tensor) -> torch.Tensor:
    """``[layers, n, kv_width]`` canonical rows of ``slots``, read by the torch path."""
    index = conn._index(slots.to(conn.device))
    return torch.stack([conn._gather(i, index, slots.numel()) for i in range(conn.num_layers)])


def _pool_bits(conn: SGLangKVConnector) -> list[torch.Tensor]:
    return [_bits(t) for parts in conn._layers for t in parts]


def _stored(kind: str, device: str, seed: int, ranges=RANGES) -> list[ChunkTransfer]:
    """Chunks stored through the kernel path, each carrying the sum the store returned."""
    src = _conn(kind, device, seed)
    chunks = _chunks(src, ranges)
    sums = src.from_gpu(chunks, TransferSpec(_slots(ranges[-1][1], seed + 1)))
    src.synchronize()
    assert sums is not None
    return [dataclasses.replace(c, checksum=s) for c, s in zip(chunks, sums.values(), strict=True)]


def _damage(chunks: list[ChunkTransfer], damage: str) -> None:
    """Corrupt chunk 1: one flipped bit, or the bytes of chunk 2 (same size) in its place."""
    if damage == "flipped_bit":
        chunks[1].buffer.reshape(-1).view(torch.uint8)[7] ^= 0x20
    else:
        chunks[1].buffer.copy_(chunks[2].buffer)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_store_sums_are_the_host_checksums(kind: str, device: str) -> None:
    """The kernel store copies the torch path's bytes and returns their checksums."""
    slots = _slots(RANGES[-1][1], 2)
    conn, ref = _conn(kind, device, 1), _conn(kind, device, 1, kernels=False)
    got, want = _chunks(conn), _chunks(ref)
    sums = conn.from_gpu(got, TransferSpec(slots))
    conn.synchronize()
    assert ref.from_gpu(want, TransferSpec(slots)) is None
    assert sums is not None
    assert sums.values() == [chunk_checksum(c.buffer) for c in got]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a.buffer), _bits(b.buffer))
    assert len(set(sums.values())) == len(got)  # distinct chunks, distinct sums


@pytest.mark.parametrize("device", DEVICES)
def test_a_deferred_store_is_complete_once_its_stream_is(device: str) -> None:
    """A deferred store on a stream returns once its copies are enqueued (on CUDA); the bytes
    and sums are there after the stream's work, and the engine's pages are released once."""
    conn = _conn("mha", device, 29)
    backend = conn.backend
    stream = backend.new_stream(conn.device)
    read: list[int] = []
    chunks = _chunks(conn)
    spec = TransferSpec(
        _slots(RANGES[-1][1], 30),
        stream=stream,
        deferred=True,
        on_engine_read=lambda: read.append(1),
    )
    sums = conn.from_gpu(chunks, spec)
    if backend.has_streams:
        backend.stream_synchronize(stream)
    assert read == [1] and sums is not None
    assert sums.values() == [chunk_checksum(c.buffer) for c in chunks]
    want = _chunks(conn)
    ref = _conn("mha", device, 29, kernels=False)
    ref.from_gpu(want, spec)
    assert all(
        torch.equal(_bits(a.buffer), _bits(b.buffer)) for a, b in zip(chunks, want, strict=True)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("skip", [0, 3, 9])
@pytest.mark.parametrize("damage", ["flipped_bit", "other_chunk"])
def test_verified_load_writes_only_matching_chunks(
    kind: str, device: str, skip: int, damage: str
) -> None:
    chunks = _stored(kind, device, 3)
    _damage(chunks, damage)
    dst = _conn(kind, device, 5)
    ref = _conn(kind, device, 5, kernels=False)  # the same poison
    spec = TransferSpec(_slots(RANGES[-1][1], 6), skip_tokens=skip)
    checks = dst.to_gpu(chunks, spec)
    dst.synchronize()
    assert checks is not None and checks.verified
    staged = [i for i, c in enumerate(chunks) if c.end > skip]
    assert checks.chunks == staged
    assert checks.ok() == [i != 1 for i in staged]
    ref.to_gpu([c for i, c in enumerate(chunks) if i != 1], spec)
    for a, b in zip(_pool_bits(dst), _pool_bits(ref), strict=True):
        assert torch.equal(a, b)  # good chunks as the reference; chunk 1's slots keep the poison
    bad = spec.slot_mapping[max(skip, 8) : 16]
    poison = _read(_conn(kind, device, 5, kernels=False), bad)
    assert torch.equal(_bits(_read(dst, bad)), _bits(poison))
    good = spec.slot_mapping[max(skip, 16) : 24]
    assert torch.equal(_bits(_read(dst, good)), _bits(chunks[2].buffer[:, max(skip, 16) - 16 :]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mha", "hnd", "mla", "mha_fp8"])
def test_unchecked_chunks_load_like_the_reference(kind: str, device: str) -> None:
    """Chunks without a sum (stored before checksums were on) are written, unchecked."""
    chunks = [dataclasses.replace(c, checksum=None) for c in _stored(kind, device, 7)]
    spec = TransferSpec(_slots(RANGES[-1][1], 8), skip_tokens=3)
    dst, ref = _conn(kind, device, 9), _conn(kind, device, 9, kernels=False)
    assert dst.to_gpu(chunks, spec) is None
    dst.synchronize()
    ref.to_gpu(chunks, spec)
    for a, b in zip(_pool_bits(dst), _pool_bits(ref), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mha", "hnd", "mla", "mla_fp8"])
def test_layerwise_load_sums_add_up(kind: str, device: str) -> None:
    chunks = _stored(kind, device, 11)
    chunks[2].buffer.reshape(-1).view(torch.uint8)[3] ^= 0x01
    dst, ref = _conn(kind, device, 13), _conn(kind, device, 13, kernels=False)
    spec = TransferSpec(_slots(RANGES[-1][1], 14), skip_tokens=9)
    total = [0] * len(chunks)
    calls = [dst.to_gpu_layers(range(0, 2), chunks, spec), dst.to_gpu_layer(2, chunks, spec)]
    dst.synchronize()
    for checks, layers in zip(calls, [range(0, 2), range(2, 3)], strict=True):
        assert checks is not None and not checks.verified and checks.layers == layers
        assert checks.chunks == [1, 2, 3]  # chunk 0 lies before skip_tokens: not staged
        for pos, value in zip(checks.chunks, checks.sums(), strict=True):
            total[pos] += value
    got = [t % (1 << 64) for t in total[1:]]
    assert got == [chunk_checksum(c.buffer) for c in chunks[1:]]
    assert [g == c.checksum for g, c in zip(got, chunks[1:], strict=True)] == [True, False, True]
    ref.to_gpu(chunks, spec)  # a layerwise load writes every chunk; the engine drops the bad one
    for a, b in zip(_pool_bits(dst), _pool_bits(ref), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_sums_of_odd_rows_are_left_to_the_host(device: str) -> None:
    """Rows that are not whole 64-bit words: a layer's load returns no sums (the engine hashes
    the chunk on the host); a load of all layers still verifies."""
    chunks = _stored("odd", device, 15)
    _damage(chunks, "flipped_bit")
    spec = TransferSpec(_slots(RANGES[-1][1], 16))
    dst, ref = _conn("odd", device, 17), _conn("odd", device, 17, kernels=False)
    assert dst.to_gpu_layer(0, chunks, spec) is None
    dst.synchronize()
    ref.to_gpu_layer(0, chunks, spec)
    assert all(torch.equal(a, b) for a, b in zip(_pool_bits(dst), _pool_bits(ref), strict=True))
    checks = dst.to_gpu(chunks, spec)
    dst.synchronize()
    assert checks is not None and checks.ok() == [True, False, True, True]


@pytest.mark.parametrize("device", DEVICES)
def test_a_slot_outside_the_pool_is_refused(device: str) -> None:
    """The kernels skip a slot outside the pool without a word; the host refuses it first."""
    conn = _conn("mha", device, 19)
    chunks = _chunks(conn, [(0, 8)])
    slots = _slots(8, 20)
    slots[5] = SLOTS
    with pytest.raises(ValueError, match="beyond the pool"):
        conn.from_gpu(chunks, TransferSpec(slots))
    stored = _stored("mha", device, 21, [(0, 8)])
    with pytest.raises(ValueError, match="beyond the pool"):
        conn.to_gpu(stored, TransferSpec(slots))
    slots[5] = -1
    with pytest.raises(ValueError, match="negative slots"):
        conn.to_gpu(stored, TransferSpec(slots))
    conn.to_gpu(stored, TransferSpec(slots, skip_tokens=6))  # -1 only where the engine holds


def test_the_kernel_path_is_cuda_only_and_needs_uniform_layers() -> None:
    """A CPU connector keeps the torch path (the engine hashes on the host); pools the kernels
    cannot address get no kernel path."""
    conn = _conn("mha", "cpu", 23, kernels=False)
    assert (
        SGLangKVConnector(conn.config, conn.metadata, conn.engine, conn.layout_hints).kernels
        is None
    )
    md = _md("mha")
    k = torch.zeros(LAYERS, SLOTS, 2, 8, dtype=md.kv_dtype)
    odd = torch.zeros(SLOTS, 8, 2, dtype=md.kv_dtype).transpose(1, 2)  # strided last axis
    v = torch.zeros(LAYERS, SLOTS, 2, 4, dtype=md.kv_dtype)
    caches = [(k[0], v[0]), (odd, v[1]), (k[2], v[2])]
    mixed = SGLangKVConnector(LMCacheConfig(chunk_size=8), md, EngineInfo("sglang", "cpu", caches))
    assert mixed.kernel_transfer() is None
    assert LMCacheConfig().checksum_for("cuda", mixed.verifies_checksums) is False
    assert LMCacheConfig().checksum_for("cuda", _conn("mha", "cpu", 23).verifies_checksums)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_the_engine_keeps_device_sums_and_misses_a_bad_chunk(kind: str, device: str) -> None:
    """Through the cache engine: the stored chunks keep the device's sums (no host hashing),
    and a retrieve reports a corrupted chunk as not loaded, counts it and never writes it."""
    conn = _conn(kind, device, 25)
    md = conn.metadata
    engine = LMCacheEngine(LMCacheConfig(chunk_size=8), md, conn)
    tokens = list(range(24))
    slots = _slots(24, 26)
    assert engine.store(tokens, None, TransferSpec(slots)) == 24
    assert isinstance(engine.tier, CPUTier)
    entries = list(engine.tier._entries.values())
    assert len(entries) == 3
    for e in entries:
        assert e.checksum is None and e.lease.checksum == chunk_checksum(e.lease.tensor)
    entries[1].lease.tensor.reshape(-1).view(torch.uint8)[5] ^= 0x04
    dst = _conn(kind, device, 27)
    before = _pool_bits(dst)
    engine.set_gpu_connector(dst)
    out = _slots(24, 28)
    mask = engine.retrieve(tokens, None, TransferSpec(out))
    expected = torch.ones(24, dtype=torch.bool)
    expected[8:16] = False
    assert torch.equal(mask.cpu(), expected)
    assert engine.metrics.value("checksum_failures") == 1
    source = _conn(kind, device, 25, kernels=False)  # the pools the chunks were stored from
    for t in (0, 16):  # good chunks loaded bit for bit
        assert torch.equal(
            _bits(_read(dst, out[t : t + 8])), _bits(_read(source, slots[t : t + 8]))
        )
    poison = _conn(kind, device, 27, kernels=False)  # the bad chunk's slots never written
    assert torch.equal(_bits(_read(dst, out[8:16])), _bits(_read(poison, out[8:16])))
    assert any(not torch.equal(a, b) for a, b in zip(before, _pool_bits(dst), strict=True))
    engine.close()


def _with_kernels(cls: type) -> type:
    """``cls`` (a conformance suite class) with the kernel path attached to every connector."""

    def factory(config, metadata, engine, hints):  # type: ignore[no-untyped-def]
        conn = SGLangKVConnector(config, metadata, engine, hints)
        if conn.kernels is None:
            conn.kernels = conn.kernel_transfer()
        assert conn.kernels is not None
        return conn

    return type(
        f"{cls.__name__}Kernels", (cls,), {"connector_factory": property(lambda self: factory)}
    )


TestMHAKernels = _with_kernels(suite.TestSGLangMHA)
TestHostPageFirstKernels = _with_kernels(suite.TestSGLangHostPageFirst)
TestPagedNHDKernels = _with_kernels(suite.TestSGLangPagedNHD)
TestPagedHNDKernels = _with_kernels(suite.TestSGLangPagedHND)
TestMLAKernels = _with_kernels(suite.TestSGLangMLA)
