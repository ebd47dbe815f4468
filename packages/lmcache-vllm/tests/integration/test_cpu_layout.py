# SPDX-License-Identifier: Apache-2.0
"""vLLM's CPU block formats (``cpu_kt_v``, ``cpu_amx``) against vLLM's own cache-write kernel."""

from __future__ import annotations

import pytest
import torch

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import ChunkTransfer, EngineInfo, TransferSpec
from lmcache.metadata import LMCacheMetadata
from lmcache_vllm.gpu_connector import VLLMPagedConnector
from lmcache_vllm.transfer.kv_formats import gather_layer

CASES = [
    (isa, dtype, block, head)
    for isa in ("vec", "amx")
    for dtype in (torch.float32, torch.bfloat16)
    for block, head in ((16, 32), (32, 64), (32, 128), (64, 128))
    # the kernels' own constraints: vec16 for block 16, AMX only for bf16 and blocks of 32k
    if not (isa == "amx" and (dtype != torch.bfloat16 or block % 32))
]


@pytest.mark.parametrize(("isa", "dtype", "block", "head"), CASES)
def test_connector_moves_what_vllm_cpu_kernel_writes(isa, dtype, block, head):
    from vllm import _custom_ops as ops

    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles: vLLM's amx kernel cannot run here")
    if isa == "vec" and block % 32:
        isa = "vec16"
    fmt = "cpu_amx" if isa == "amx" else "cpu_kt_v"
    heads, blocks, n = 2, 5, 3 * block - 7
    cache = torch.zeros(blocks, heads, block, 2 * head, dtype=dtype)
    kc, vc = cache.view(blocks, heads, 2 * block, head).chunk(2, dim=2)
    key = torch.randn(n, heads, head).to(dtype)
    value = torch.randn(n, heads, head).to(dtype)
    slots = torch.randperm((blocks - 1) * block)[:n] + block  # never the null block
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    md = LMCacheMetadata("m", 1, 0, 0, 1, dtype, 1, heads, head, head, chunk_size=block)

    def connector(caches: list[torch.Tensor]) -> VLLMPagedConnector:
        return VLLMPagedConnector(
            LMCacheConfig(chunk_size=block),
            md,
            EngineInfo(name="vllm", device="cpu", kv_caches=caches, extra={"block_size": block}),
            {"kv_format": fmt},
        )

    conn = connector([cache])
    want = torch.cat((key.reshape(n, -1), value.reshape(n, -1)), dim=1)
    got = gather_layer(fmt, conn.cache.caches[0], head, slots // block, slots % block)
    assert torch.equal(got, want), isa
    # through the connector API: save chunks, load them into an empty cache, which must then
    # hold exactly the bytes vLLM's kernel wrote
    spans = [(s, min(s + block, n)) for s in range(0, n, block)]
    bufs = [torch.full((1, e - s, md.kv_width), float("nan"), dtype=dtype) for s, e in spans]
    chunks = [ChunkTransfer(s, e, b) for (s, e), b in zip(spans, bufs, strict=True)]
    conn.from_gpu(chunks, TransferSpec(slots))
    assert torch.equal(torch.cat(bufs, dim=1)[0], want)
    empty = torch.zeros_like(cache)
    connector([empty]).to_gpu(chunks, TransferSpec(slots))
    assert torch.equal(
        empty.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        cache.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )
