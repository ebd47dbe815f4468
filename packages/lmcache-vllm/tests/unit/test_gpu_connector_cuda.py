# SPDX-License-Identifier: Apache-2.0
"""The conformance suite on real CUDA tensors (FlashAttention's LBNHC order, LBHNC, MLA)."""

from __future__ import annotations

import pytest
import torch

from lmcache.gpu_connector import EngineInfo
from lmcache_vllm.gpu_connector import VLLMPagedConnector
from lmcache_vllm.transfer.fused.store import FusedStore
from lmcache_vllm.transfer.fused.views import FusedViews
from lmcache_vllm.transfer.token_transfer import TokenTransfer

from . import test_gpu_connector_conformance as cpu_suite

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _to_cuda(engine: EngineInfo, permute_back: bool = False) -> EngineInfo:
    phys = engine.extra["phys"].cuda()
    layers = engine.kv_caches
    views = [phys[i].permute(0, 2, 1, 3) if permute_back else phys[i] for i in range(len(layers))]
    return EngineInfo(
        name="vllm", device="cuda", kv_caches=views, extra={**engine.extra, "phys": phys}
    )


class _Cuda:
    connector_factory = staticmethod(VLLMPagedConnector)

    def layout_hints(self, metadata):
        return {"kv_format": "mla" if metadata.use_mla else "kv_concat"}


class TestCudaLBNHC(_Cuda, cpu_suite.TestVllmLBNHC):
    def make_engine(self, metadata):
        return _to_cuda(super().make_engine(metadata), permute_back=True)


class TestCudaLBHNC(_Cuda, cpu_suite.TestVllmLBHNC):
    def make_engine(self, metadata):
        return _to_cuda(super().make_engine(metadata))


class TestCudaMLA(_Cuda, cpu_suite.TestVllmMLA):
    def make_engine(self, metadata):
        return _to_cuda(super().make_engine(metadata))


def test_transfer_on_a_side_stream():
    from lmcache.config import LMCacheConfig
    from lmcache.gpu_connector import ChunkTransfer, TransferSpec
    from lmcache.metadata import LMCacheMetadata

    md = LMCacheMetadata(
        model_name="m",
        world_size=1,
        worker_id=0,
        local_worker_id=0,
        local_world_size=1,
        kv_dtype=torch.bfloat16,
        num_layers=2,
        num_kv_heads=2,
        head_size_k=64,
        head_size_v=64,
        chunk_size=16,
    )
    phys = torch.randn(2, 8, 16, 2, 128, device="cuda").to(torch.bfloat16)
    views = [phys[i].permute(0, 2, 1, 3) for i in range(2)]
    conn = VLLMPagedConnector(
        LMCacheConfig(chunk_size=16), md, EngineInfo(name="vllm", device="cuda", kv_caches=views)
    )
    slots = torch.arange(16, 48, device="cuda")
    stream = torch.cuda.Stream()
    bufs = [torch.empty(2, 16, 256, dtype=torch.bfloat16).pin_memory() for _ in range(2)]
    chunks = [ChunkTransfer(0, 16, bufs[0]), ChunkTransfer(16, 32, bufs[1])]
    conn.from_gpu(chunks, TransferSpec(slots, stream=stream))
    # K||V per head on the C axis -> canonical [all K heads, all V heads]
    x = phys.reshape(2, 128, 2, 128)[:, 16:48]
    canon = torch.cat((x[..., :64].reshape(2, 32, 128), x[..., 64:].reshape(2, 32, 128)), -1)
    got = torch.cat(bufs, dim=1)
    assert torch.equal(got, canon.cpu())
    phys.zero_()  # on the current stream: the connector orders its stream after it
    conn.to_gpu(chunks, TransferSpec(slots, stream=stream))
    conn.synchronize()
    y = phys.reshape(2, 128, 2, 128)[:, 16:48]
    back = torch.cat((y[..., :64].reshape(2, 32, 128), y[..., 64:].reshape(2, 32, 128)), -1)
    assert torch.equal(back.cpu(), got)


@pytest.mark.parametrize("alloc", ["one-buffer", "per-layer"])
@pytest.mark.parametrize("slots_on", ["cuda", "cpu"])
@pytest.mark.parametrize("tokens", [256, 1000])
def test_fused_pipelined_matches_per_layer_llama_like(slots_on, tokens, alloc, monkeypatch):
    """Llama-like heads on FlashAttention's LBNHC, pinned pool chunks, pipelined in 1 MiB
    pieces (chunks cut by layers) against the token-level path, NaN payloads included; layers
    in one buffer (vLLM 0.32) or allocated one by one (vLLM 0.26)."""
    from lmcache.config import LMCacheConfig
    from lmcache.gpu_connector import ChunkTransfer, TransferSpec
    from lmcache.memory.pinned_pool import HostMemoryPool
    from lmcache.metadata import LMCacheMetadata

    L, H, D, P, CS, NB = 4, 8, 128, 16, 256, 200
    md = LMCacheMetadata(
        model_name="m",
        world_size=1,
        worker_id=0,
        local_worker_id=0,
        local_world_size=1,
        kv_dtype=torch.bfloat16,
        num_layers=L,
        num_kv_heads=H,
        head_size_k=D,
        head_size_v=D,
        chunk_size=CS,
    )

    def engine(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        phys = torch.randint(-32768, 32767, (L, NB, P, H, 2 * D), device="cuda", generator=g)
        phys = phys.to(torch.int16).view(torch.bfloat16)  # every bit pattern, NaNs too
        views = [phys[i].permute(0, 2, 1, 3) for i in range(L)]
        if alloc == "per-layer":
            views = [v.permute(0, 2, 1, 3).clone().permute(0, 2, 1, 3) for v in views]
        return phys, views

    def conn(views, fused=True):
        c = VLLMPagedConnector(
            LMCacheConfig(chunk_size=CS), md, EngineInfo("vllm", "cuda", views, {"block_size": P})
        )
        assert (c.transfer.views.fused is not None) == (alloc == "one-buffer")
        assert (c.transfer.views.fused_layers is not None) == (alloc == "per-layer")
        if not fused:
            c.transfer = TokenTransfer(c.cache, c.backend, c.device)
        return c

    monkeypatch.setattr(FusedViews, "pipeline_bytes", 1 << 20)
    pages = torch.randperm(NB - 1)[: -(-tokens // P)] + 1
    slots = (pages[:, None] * P + torch.arange(P)).reshape(-1)[:tokens].to(slots_on)
    ranges = [(s, min(s + CS, tokens)) for s in range(0, tokens, CS)]
    pool = HostMemoryPool(256 << 20)
    _, src = engine(1)
    fast, ref = conn(src), conn(src, fused=False)
    leases = [pool.allocate(fast.chunk_shape(e - s), torch.bfloat16) for s, e in ranges]
    refs = [torch.empty(fast.chunk_shape(e - s), dtype=torch.bfloat16) for s, e in ranges]
    assert fast.transfer.views.staging_plan(range(L), [ChunkTransfer(s, e, x.tensor) for (s, e), x in zip(
        ranges, leases, strict=True)], 0).pieces > 1  # fmt: skip
    chunks = [ChunkTransfer(s, e, x.tensor) for (s, e), x in zip(ranges, leases, strict=True)]
    fast.from_gpu(chunks, TransferSpec(slots))
    ref.from_gpu([ChunkTransfer(s, e, x) for (s, e), x in zip(ranges, refs, strict=True)],
                 TransferSpec(slots))  # fmt: skip
    for x, y in zip(leases, refs, strict=True):
        assert torch.equal(x.tensor.view(torch.int16), y.view(torch.int16))
    skip = CS + 7 if tokens > CS else 5
    _, dst_a = engine(2)
    _, dst_b = engine(2)
    stream = torch.cuda.Stream()
    conn(dst_a).to_gpu(chunks, TransferSpec(slots, skip_tokens=skip, stream=stream))
    conn(dst_b, fused=False).to_gpu(chunks, TransferSpec(slots, skip_tokens=skip))
    torch.cuda.synchronize()
    for a, b in zip(dst_a, dst_b, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for x in leases:
        x.release()


@pytest.mark.parametrize("alloc", ["one-buffer", "per-layer"])
def test_prefetched_chunks_load_like_host_chunks(alloc, monkeypatch):
    """A load from ``prefetch``'s device copy writes exactly what a load from the host writes,
    with no host copy at load time; a skip that drops leading chunks uses the rest of the copy;
    chunks the copy does not cover fall back to the host."""
    from lmcache.config import LMCacheConfig
    from lmcache.gpu_connector import ChunkTransfer, TransferSpec
    from lmcache.memory.pinned_pool import HostMemoryPool
    from lmcache.metadata import LMCacheMetadata
    from lmcache_vllm.transfer.fused.transfer import Prefetched

    L, H, D, P, CS, NB, N = 3, 4, 64, 16, 64, 64, 200
    md = LMCacheMetadata(
        model_name="m", world_size=1, worker_id=0, local_worker_id=0, local_world_size=1,
        kv_dtype=torch.bfloat16, num_layers=L, num_kv_heads=H, head_size_k=D, head_size_v=D,
        chunk_size=CS,
    )  # fmt: skip

    def engine(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        phys = torch.randint(-32768, 32767, (L, NB, P, H, 2 * D), device="cuda", generator=g)
        views = [phys.to(torch.int16).view(torch.bfloat16)[i].permute(0, 2, 1, 3) for i in range(L)]
        if alloc == "per-layer":
            views = [v.permute(0, 2, 1, 3).clone().permute(0, 2, 1, 3) for v in views]
        return views

    def conn(views):
        return VLLMPagedConnector(
            LMCacheConfig(chunk_size=CS), md, EngineInfo("vllm", "cuda", views, {"block_size": P})
        )

    pool = HostMemoryPool(64 << 20)
    src = conn(engine(1))
    ranges = [(s, min(s + CS, N)) for s in range(0, N, CS)]
    leases = [pool.allocate(src.chunk_shape(e - s), torch.bfloat16) for s, e in ranges]
    chunks = [ChunkTransfer(s, e, x.tensor) for (s, e), x in zip(ranges, leases, strict=True)]
    slots = (torch.randperm(NB - 1)[: -(-N // P)] + 1)[:, None] * P + torch.arange(P)
    slots = slots.reshape(-1)[:N]
    src.from_gpu(chunks, TransferSpec(slots))
    stream = torch.cuda.Stream()
    pre = src.prefetch(chunks, stream)
    assert isinstance(pre, Prefetched)
    copies = []
    real_copy_runs = FusedViews.copy_runs
    monkeypatch.setattr(
        FusedViews,
        "copy_runs",
        lambda self, *a, **k: (copies.append(1), real_copy_runs(self, *a, **k)),
    )
    for skip in (0, 5, CS + 3):  # 5: inside chunk 0; CS + 3: chunk 0 dropped, suffix used
        lslots = slots.clone()
        lslots[:skip] = -1
        a, b = engine(2), engine(2)
        conn_a, conn_b = conn(a), conn(b)  # (their warm-up transfers copy: not counted)
        copies.clear()
        conn_a.to_gpu(chunks, TransferSpec(lslots, skip_tokens=skip, staged=pre))
        assert copies == []  # scattered from the device copy
        conn_b.to_gpu(chunks, TransferSpec(lslots, skip_tokens=skip))
        torch.cuda.synchronize()
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    # copied in layer groups: each layer range scatters after its own group's copy; a group of
    # the three equal chunks (back to back in the pool) is one strided DMA, the short last
    # chunk its own copy
    from lmcache.devices.cuda import cudart

    assert cudart() is not None  # else strided runs would go row by row
    strided = []
    backend_type = type(src.backend)
    real_2d = backend_type.copy_2d
    monkeypatch.setattr(
        backend_type,
        "copy_2d",
        lambda self, dst, dp, s, sp, w, h, *a: (
            strided.append(h),
            real_2d(self, dst, dp, s, sp, w, h, *a),
        )[1],
    )
    grouped = src.prefetch(chunks, stream, [range(0, 1), range(1, L)])
    assert strided == [3, 3]
    assert isinstance(grouped, Prefetched)
    assert [stop for stop, _ in grouped.layer_events] == [1, L]
    assert grouped.event_for(1) is grouped.layer_events[0][1]
    assert grouped.event_for(2) is grouped.event
    gap = src.prefetch(chunks, stream, [range(0, 1), range(2, L)])  # layer 1 missing: one copy
    assert gap is not None and gap.layer_events == [] and gap.event_for(1) is gap.event
    for skip in (0, 5, CS + 3):
        lslots = slots.clone()
        lslots[:skip] = -1
        a, b = engine(4), engine(4)
        ca, cb = conn(a), conn(b)  # (their warm-up transfers copy: not counted)
        copies.clear()
        for layers in (range(0, 1), range(1, 2), range(2, L)):  # not the copy's groups
            ca.to_gpu_layers(layers, chunks, TransferSpec(lslots, skip_tokens=skip, staged=grouped))
            cb.to_gpu_layers(layers, chunks, TransferSpec(lslots, skip_tokens=skip))
        assert len(copies) == 3  # b's three host copies only
        torch.cuda.synchronize()
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    other = [ChunkTransfer(0, CS, pool.allocate(src.chunk_shape(CS), torch.bfloat16).tensor)]
    other[0].buffer.copy_(chunks[0].buffer)
    a, b = engine(3), engine(3)
    copies.clear()
    conn(a).to_gpu(other, TransferSpec(slots[:CS], staged=pre))  # other buffer: not covered
    assert copies  # from the host
    conn(b).to_gpu(chunks[:1], TransferSpec(slots[:CS]))
    torch.cuda.synchronize()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("path", ["kernel", "strided"])
@pytest.mark.parametrize("alloc", ["one-buffer", "per-layer"])
def test_prepared_store_copies_what_the_pages_hold_at_copy_time(alloc, path, monkeypatch):
    """``prepare_store`` plans a store and uploads its slot indices ahead (on the store stream,
    before the KV exists); the deferred ``from_gpu`` given that plan then builds no indices,
    reads the pages as they are when it runs (written after the prepare, on the compute
    stream) and matches the token-level path bit for bit. A plan made for another chunk list
    is ignored, not misused; a layerwise store's per-layer copies reuse its indices."""
    from lmcache.config import LMCacheConfig
    from lmcache.gpu_connector import ChunkTransfer, TransferSpec
    from lmcache.memory.pinned_pool import HostMemoryPool
    from lmcache.metadata import LMCacheMetadata
    from lmcache_vllm.transfer.fused.kernels import ChunkKernels

    monkeypatch.setattr(FusedStore, "kernel_gather", path == "kernel")
    L, H, D, P, CS, NB, N = 4, 8, 128, 16, 256, 128, 900
    md = LMCacheMetadata(
        model_name="m", world_size=1, worker_id=0, local_worker_id=0, local_world_size=1,
        kv_dtype=torch.bfloat16, num_layers=L, num_kv_heads=H, head_size_k=D, head_size_v=D,
        chunk_size=CS,
    )  # fmt: skip
    phys = torch.zeros(L, NB, P, H, 2 * D, device="cuda", dtype=torch.bfloat16)
    views = [phys[i].permute(0, 2, 1, 3) for i in range(L)]
    if alloc == "per-layer":
        views = [v.permute(0, 2, 1, 3).clone().permute(0, 2, 1, 3) for v in views]

    def conn(fused=True):
        c = VLLMPagedConnector(
            LMCacheConfig(chunk_size=CS), md, EngineInfo("vllm", "cuda", views, {"block_size": P})
        )
        if not fused:
            c.transfer = TokenTransfer(c.cache, c.backend, c.device)
        return c

    fast, ref = conn(), conn(fused=False)
    pool = HostMemoryPool(128 << 20)
    ranges = [(s, min(s + CS, N)) for s in range(0, N, CS)]
    slots = ((torch.randperm(NB - 1)[: -(-N // P)] + 1)[:, None] * P + torch.arange(P)).reshape(-1)
    slots = slots[:N]
    store = torch.cuda.Stream()

    def leased():
        leases = [pool.allocate(fast.chunk_shape(e - s), torch.bfloat16) for s, e in ranges]
        return leases, [ChunkTransfer(s, e, x.tensor) for (s, e), x in zip(ranges, leases, strict=True)]  # fmt: skip

    leases, chunks = leased()
    spec = TransferSpec(slots, stream=store, deferred=True)
    with torch.cuda.stream(store):
        prepared = fast.prepare_store(chunks, spec)
    assert prepared is not None
    torch.cuda._sleep(50_000_000)  # the step's forward, still running ...
    g = torch.Generator(device="cuda").manual_seed(3)
    for v in views:  # ... writes the KV (every bit pattern, NaNs too)
        v.copy_(torch.randint(-32768, 32767, v.shape, device="cuda", generator=g).to(torch.int16).view(torch.bfloat16))  # fmt: skip
    ready = torch.cuda.Event()
    ready.record()
    built = []  # index builds: the kernel's (raw slots) and the strided path's
    real_k, real_s = ChunkKernels.load_index, FusedViews.slot_indices
    monkeypatch.setattr(
        ChunkKernels, "load_index", lambda self, *a: (built.append("kernel"), real_k(self, *a))[1]
    )
    monkeypatch.setattr(
        FusedViews,
        "slot_indices",
        lambda self, *a: (built.append("strided"), real_s(self, *a))[1],
    )
    checked = []
    check = type(fast).check_chunks
    monkeypatch.setattr(
        type(fast), "check_chunks", lambda self, *a: (checked.append(1), check(self, *a))[1]
    )
    store.wait_event(ready)
    with torch.cuda.stream(store):
        fast.from_gpu(chunks, TransferSpec(slots, stream=store, deferred=True, prepared=prepared))
    store.synchronize()
    assert built == []  # the prepared indices were used
    assert checked == []  # and the chunks prepare_store checked are not checked again
    refs = [torch.empty(fast.chunk_shape(e - s), dtype=torch.bfloat16) for s, e in ranges]
    ref.from_gpu([ChunkTransfer(s, e, x) for (s, e), x in zip(ranges, refs, strict=True)],
                 TransferSpec(slots))  # fmt: skip
    for x, y in zip(leases, refs, strict=True):
        assert torch.equal(x.tensor.view(torch.int16), y.view(torch.int16))

    other, other_chunks = leased()  # a plan of another chunk list: planned again, still exact
    checked.clear()  # (the reference copy above was checked too: same class)
    with torch.cuda.stream(store):
        fast.from_gpu(other_chunks, TransferSpec(slots, stream=store, prepared=prepared))
    assert built == [path] and checked == [1]
    for x, y in zip(other, refs, strict=True):
        assert torch.equal(x.tensor.view(torch.int16), y.view(torch.int16))

    # layerwise: one prepare for the store, its indices reused by every layer's copy
    per_layer, layer_chunks = leased()
    built.clear()
    spec = TransferSpec(slots, stream=store, deferred=True)
    with torch.cuda.stream(store):
        spec = TransferSpec(slots, stream=store, prepared=fast.prepare_store(layer_chunks, spec))
        assert built == [path]
        for layer in range(L):
            fast.from_gpu_layer(layer, list(layer_chunks), spec)
    # every layer's copy reuses the index of the prepared store (a kernel store's layers go
    # through the gather kernel too, each summing its layer)
    assert built == [path]
    for x, y in zip(per_layer, refs, strict=True):
        assert torch.equal(x.tensor.view(torch.int16), y.view(torch.int16))
    for x in leases + other + per_layer:
        x.release()
