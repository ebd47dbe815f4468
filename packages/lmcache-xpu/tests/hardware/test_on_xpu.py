# SPDX-License-Identifier: Apache-2.0
"""On a real Intel GPU: the backend's copies and the vLLM/SGLang connectors over XPU tensors.

These have never run on hardware (none was available); run them on an XPU machine with
``pytest packages/lmcache-xpu/tests/hardware -m xpu`` (torch built with XPU support).
"""

from __future__ import annotations

import pytest
import torch

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import CreateGPUConnector, EngineInfo
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache.testing.conformance import default_metadata_cases
from lmcache_xpu.device import XpuBackend
from lmcache_xpu.testing import register_xpu_connectors

pytestmark = [
    pytest.mark.xpu,
    pytest.mark.skipif(
        not (hasattr(torch, "xpu") and torch.xpu.is_available()),
        reason="needs an Intel GPU and a torch built with XPU support (torch.xpu.is_available())",
    ),
]


def test_copies_both_ways_on_a_stream() -> None:
    backend = XpuBackend()
    dev = backend.device_for_rank(0)
    stream = backend.new_stream(dev)
    host = backend.pinned_empty(1 << 20)
    host.copy_(torch.randint(0, 255, (1 << 20,), dtype=torch.uint8))
    on_dev = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    back = backend.pinned_empty(1 << 20)
    backend.copy(on_dev, host, stream)
    backend.copy(back, on_dev, stream)
    backend.event_synchronize(backend.event_after(stream))
    assert torch.equal(back, host)


@pytest.mark.parametrize("engine_name", ["vllm", "sglang"])
def test_connector_round_trip_on_xpu_tensors(engine_name: str) -> None:
    from lmcache.devices import register_backend

    register_backend(XpuBackend(), clobber=True)
    register_xpu_connectors()
    md = next(m for m in default_metadata_cases() if not m.use_mla)
    dev = torch.device("xpu", 0)
    L, H = md.num_layers, md.num_kv_heads
    if engine_name == "vllm":
        c = md.head_size_k + md.head_size_v
        phys = torch.randn(L, 8, 4, H, c, device=dev).to(md.kv_dtype)  # FlashAttention LBNHC
        caches: list[object] = [phys[i].permute(0, 2, 1, 3) for i in range(L)]
        engine = EngineInfo("vllm", "xpu", caches, {"block_size": 4})
    else:
        phys = torch.randn(2, L, 32, H, md.head_size_k, device=dev).to(md.kv_dtype)
        v = torch.randn(L, 32, H, md.head_size_v, device=dev).to(md.kv_dtype)
        engine = EngineInfo("sglang", "xpu", [(phys[0, i], v[i]) for i in range(L)])
    conn = CreateGPUConnector(LMCacheConfig(), md, engine, None)
    backend = conn.backend
    load, store = backend.new_stream(dev), backend.new_stream(dev)
    n = 8
    buf = torch.zeros(L, n, conn.kv_width, dtype=md.kv_dtype)
    slots = torch.arange(4, 4 + n)
    conn.from_gpu([ChunkTransfer(0, n, buf)], TransferSpec(slots, stream=store))
    before = [t.clone() for t in (phys, v)] if engine_name == "sglang" else [phys.clone()]
    for t in [phys, v] if engine_name == "sglang" else [phys]:
        t.zero_()
    conn.to_gpu([ChunkTransfer(0, n, buf)], TransferSpec(slots, stream=load))
    conn.synchronize()
    after = [phys, v] if engine_name == "sglang" else [phys]
    for a, b in zip(after, before, strict=True):
        moved = a != 0
        assert moved.any() and torch.equal(a[moved].cpu(), b[moved].cpu())
