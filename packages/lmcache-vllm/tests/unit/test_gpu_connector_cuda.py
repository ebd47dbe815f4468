# SPDX-License-Identifier: Apache-2.0
"""The conformance suite on real CUDA tensors (FlashAttention's LBNHC order, LBHNC, MLA)."""

from __future__ import annotations

import pytest
import torch

from lmcache.gpu_connector import EngineInfo
from lmcache_vllm.gpu_connector import VLLMPagedConnector

from . import test_gpu_connector_conformance as cpu_suite

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _to_cuda(engine: EngineInfo, permute_back: bool = False) -> EngineInfo:
    phys = engine.extra["phys"].cuda()
    layers = engine.kv_caches
    views = [phys[i].permute(0, 2, 1, 3) if permute_back else phys[i] for i in range(len(layers))]
    return EngineInfo(name="vllm", device="cuda", kv_caches=views,
                      extra={**engine.extra, "phys": phys})


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

    md = LMCacheMetadata(model_name="m", world_size=1, worker_id=0, local_worker_id=0,
                         local_world_size=1, kv_dtype=torch.bfloat16, num_layers=2,
                         num_kv_heads=2, head_size_k=64, head_size_v=64, chunk_size=16)
    phys = torch.randn(2, 8, 16, 2, 128, device="cuda").to(torch.bfloat16)
    views = [phys[i].permute(0, 2, 1, 3) for i in range(2)]
    conn = VLLMPagedConnector(LMCacheConfig(chunk_size=16), md,
                              EngineInfo(name="vllm", device="cuda", kv_caches=views))
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
