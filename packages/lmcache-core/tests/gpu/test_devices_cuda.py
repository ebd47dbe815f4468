# SPDX-License-Identifier: Apache-2.0
"""The CUDA device backend on a GPU: exact-size pinned memory, single, batched
(``cudaMemcpyBatchAsync``) and 2D copies in both directions, streams and events. Needs a CUDA
GPU (skips otherwise)."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from lmcache.devices import get_backend  # noqa: E402
from lmcache.devices.cuda import CudaBackend, cudart  # noqa: E402


@pytest.fixture
def cuda() -> CudaBackend:
    # torch's Tensor.is_pinned() answers False until torch has initialised CUDA in this process
    # (it never initialises it for the question); connectors always hold device tensors by then.
    torch.cuda.init()
    backend = get_backend("cuda")
    assert isinstance(backend, CudaBackend)
    return backend


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).random_(0, 256).view(t.dtype) if t.numel() else t


def test_runtime_found_and_batch_probed() -> None:
    rt = cudart()
    assert rt is not None and rt.version >= 12000
    # cudaMemcpyBatchAsync from 12.8 on; its failIdx argument only before 13.0
    assert (rt.batch is not None) == (rt.version >= 12080)
    assert rt.batch_fail_idx == (12080 <= rt.version < 13000)


@pytest.mark.parametrize("nbytes", [1, 4095, 4096 * 3 + 17, (130 << 20) + 5])
def test_pinned_empty_is_exact_and_page_locked(cuda: CudaBackend, nbytes: int) -> None:
    host = cuda.pinned_empty(nbytes)
    assert host.dtype == torch.uint8 and host.numel() == nbytes
    assert host.is_pinned() and cuda.is_pinned(host)
    _poison(host)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    back = cuda.pinned_empty(nbytes)
    stream = cuda.new_stream(torch.device("cuda"))
    cuda.copy_h2d(dev, host, stream)
    cuda.copy_d2h(back, dev, stream)
    cuda.stream_synchronize(stream)
    assert torch.equal(back, host)
    del host, back, dev
    gc.collect()  # unregistered when freed: a new buffer at the same place registers again
    again = cuda.pinned_empty(nbytes)
    assert again.is_pinned()


def test_live_small_pinned_buffers_never_overlap(cuda: CudaBackend) -> None:
    """Live small buffers hold disjoint bytes (torch's pinned allocator may pack several into one
    page; a DMA into one then still never writes another's bytes), and a copy into each lands
    only there."""
    many = [cuda.pinned_empty(16) for _ in range(64)]
    assert all(t.is_pinned() for t in many)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel(), i) for i, t in enumerate(many))
    for (_, end, i), (start, _, j) in itertools.pairwise(spans):
        assert end <= start, f"live buffers {i} and {j} overlap"
    dev = torch.arange(16 * 64, dtype=torch.uint8, device="cuda").view(64, 16)
    stream = cuda.new_stream(torch.device("cuda"))
    for i, t in enumerate(many):
        cuda.copy_d2h(t, dev[i], stream)
    cuda.stream_synchronize(stream)
    assert all(torch.equal(t, dev[i].cpu()) for i, t in enumerate(many))


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_pageable_host_memory_is_copied_by_torch(cuda: CudaBackend, direction: str) -> None:
    """Pageable host memory takes torch's copy (the raw runtime path is for page-locked memory
    only), single, batched and 2D, with the bytes intact."""
    host = _poison(torch.empty(4 << 20, dtype=torch.uint8))
    assert not host.is_pinned()
    dev = _poison(torch.empty(4 << 20, dtype=torch.uint8, device="cuda"))
    stream = cuda.new_stream(torch.device("cuda"))
    if direction == "h2d":
        cuda.copy(dev, host, stream)
        cuda.copy_batch([dev[:1024], dev[1024:4096]], [host[:1024], host[1024:4096]], stream)
        cuda.copy_2d(dev, 4096, host, 4096, 2048, 16, stream)
        cuda.stream_synchronize(stream)
        assert torch.equal(dev.cpu(), host)
    else:
        cuda.copy(host, dev, stream)
        cuda.copy_batch([host[:1024], host[1024:4096]], [dev[:1024], dev[1024:4096]], stream)
        cuda.copy_2d(host, 4096, dev, 4096, 2048, 16, stream)
        cuda.stream_synchronize(stream)
        assert torch.equal(host, dev.cpu())


def test_host_register_in_place(cuda: CudaBackend) -> None:
    t = torch.empty(3 << 20, dtype=torch.uint8)
    assert cuda.host_register(t)
    assert t.is_pinned()
    cuda.host_unregister(t)
    assert not t.is_pinned()


@pytest.mark.parametrize("default_stream", [False, True])
def test_copy_batch_both_directions(cuda: CudaBackend, default_stream: bool) -> None:
    dev = torch.device("cuda")
    stream = cuda.current_stream(dev) if default_stream else cuda.new_stream(dev)
    sizes = [1, 4096, 1 << 20, 333, 7 << 20]
    hosts = [_poison(cuda.pinned_empty(n)) for n in sizes]
    devs = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes]
    backs = [_poison(cuda.pinned_empty(n)) for n in sizes]
    with cuda.use_stream(stream):
        cuda.copy_batch(devs, hosts, stream)
        cuda.copy_batch(backs, devs, stream)
    cuda.stream_synchronize(stream)
    assert all(torch.equal(b, h) for b, h in zip(backs, hosts, strict=True))


def test_copy_2d_both_directions(cuda: CudaBackend) -> None:
    stream = cuda.new_stream(torch.device("cuda"))
    rows, width, hpitch, dpitch = 5, 3000, 7000, 4096
    host = _poison(cuda.pinned_empty(rows * hpitch))
    dev = torch.zeros(rows * dpitch, dtype=torch.uint8, device="cuda")
    cuda.copy_2d(dev, dpitch, host, hpitch, width, rows, stream)
    back = torch.zeros(rows * hpitch, dtype=torch.uint8).pin_memory()
    cuda.copy_2d(back, hpitch, dev, dpitch, width, rows, stream)
    cuda.stream_synchronize(stream)
    for i in range(rows):
        row = host[i * hpitch : i * hpitch + width]
        assert torch.equal(dev[i * dpitch : i * dpitch + width].cpu(), row)
        assert torch.equal(back[i * hpitch : i * hpitch + width], row)
        assert not back[i * hpitch + width : (i + 1) * hpitch].any()  # gaps untouched


def test_events_order_streams(cuda: CudaBackend) -> None:
    dev = torch.device("cuda")
    main, side = cuda.current_stream(dev), cuda.new_stream(dev)
    x = torch.zeros(1 << 20, device=dev)
    with cuda.use_stream(side):
        torch.cuda._sleep(20_000_000)  # a device-side delay, so the wait matters
        x.fill_(3)
        done = cuda.event_after(side, blocking=True)
    cuda.wait_event(main, done)
    y = x * 2  # on main, after side's fill
    cuda.event_synchronize(done)
    assert cuda.event_query(done)
    assert torch.equal(y, torch.full_like(x, 6))
    assert cuda.device_for_rank(0) == torch.device("cuda", 0)
