# SPDX-License-Identifier: Apache-2.0
"""The conformance suite on CUDA tensors (SGLang's MHA, paged and MLA pools on the GPU)."""

from __future__ import annotations

import pytest
import torch

from lmcache.gpu_connector import EngineInfo

from . import test_gpu_connector_conformance as cpu_suite

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run `nox -s gpu` on a CUDA machine)", allow_module_level=True)


def _to_cuda(engine: EngineInfo) -> EngineInfo:
    extra = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in engine.extra.items()}
    if "kv" in extra:
        caches: list = [extra["kv"][i] for i in range(len(engine.kv_caches))]
    elif "buf" in extra:
        buf = extra["buf"]
        caches = [(buf[0, :, i], buf[1, :, i]) for i in range(len(engine.kv_caches))]
    else:
        caches = [(extra["k"][i], extra["v"][i]) for i in range(len(engine.kv_caches))]
    return EngineInfo(name="sglang", device="cuda", kv_caches=caches, extra=extra)


class TestCudaMHA(cpu_suite.TestSGLangMHA):
    def make_engine(self, metadata):
        return _to_cuda(super().make_engine(metadata))


class TestCudaPagedHND(cpu_suite.TestSGLangPagedHND):
    def make_engine(self, metadata):
        return _to_cuda(super().make_engine(metadata))


class TestCudaMLA(cpu_suite.TestSGLangMLA):
    def make_engine(self, metadata):
        return _to_cuda(super().make_engine(metadata))


def test_side_stream_load_is_ordered() -> None:
    """A load on a side stream lands before ``synchronize()`` returns."""
    from lmcache.config import LMCacheConfig
    from lmcache.gpu_connector import ChunkTransfer, CreateGPUConnector, TransferSpec
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
    k = torch.zeros(2, 256, 2, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    engine = EngineInfo("sglang", "cuda", [(k[i], v[i]) for i in range(2)])
    conn = CreateGPUConnector(LMCacheConfig(chunk_size=16), md, engine)
    src = torch.randn(2, 16, md.kv_width).to(torch.bfloat16).pin_memory()
    slots = torch.arange(32, 48, device="cuda")
    stream = torch.cuda.Stream()
    conn.to_gpu([ChunkTransfer(0, 16, src)], TransferSpec(slots, stream=stream))
    conn.synchronize()
    expected = src.view(2, 16, 2, 2, 64)
    torch.testing.assert_close(k[:, 32:48].cpu(), expected[:, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(v[:, 32:48].cpu(), expected[:, :, 1], rtol=0, atol=0)
