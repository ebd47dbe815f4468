# SPDX-License-Identifier: Apache-2.0
"""Which block format vLLM's CPU attention writes, found by running its own cache-write kernel.

vLLM's CPU attention does not store K‖V on the last axis.
Per (block, head) it keeps K transposed (``[head_size, block_size]``) followed by V
(``[block_size, head_size]``): the ``cpu_kt_v`` format of
:mod:`lmcache_vllm.transfer.paged_connector`.
Its ``amx`` kernels (bf16 on AMX CPUs) VNNI-pack both (``cpu_amx``).
Other builds might differ again.
So at ``register_kv_caches`` the adapter writes known keys and values into a scratch cache with
vLLM's ``cpu_attn_reshape_and_cache``, and checks which format reads them back.
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import EngineInfo, KVLayoutError
from lmcache.metadata import LMCacheMetadata

__all__ = ["probe_cpu_kv_format"]


def probe_cpu_kv_format(vllm_config: Any, layer_names: list[str], cache: torch.Tensor) -> str:
    """Which block format vLLM's CPU cache-write kernel uses here (see paged_connector)."""
    from lmcache_vllm.transfer.kv_formats import gather_layer
    from lmcache_vllm.transfer.paged_connector import VLLMPagedConnector

    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return "cpu_kt_v"
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    isa = None
    for name in layer_names:
        isa = getattr(ctx.get(name), "isa", None)
        if isa:
            break
    if isa is None or not hasattr(ops, "cpu_attn_reshape_and_cache"):
        return "cpu_kt_v"
    _, heads, bs, c = cache.shape
    hs = c // 2
    scratch = torch.zeros((2, heads, bs, c), dtype=cache.dtype)
    key = torch.randn(bs, heads, hs).to(cache.dtype)
    value = torch.randn(bs, heads, hs).to(cache.dtype)
    view = scratch.view(2, heads, 2 * bs, hs)
    kc, vc = view.chunk(2, dim=2)
    slots = torch.arange(bs, 2 * bs, dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    md = LMCacheMetadata(
        model_name="probe",
        world_size=1,
        worker_id=0,
        local_worker_id=0,
        local_world_size=1,
        kv_dtype=cache.dtype,
        num_layers=1,
        num_kv_heads=heads,
        head_size_k=hs,
        head_size_v=hs,
        chunk_size=bs,
    )
    want = torch.cat((key.reshape(bs, -1), value.reshape(bs, -1)), dim=1)
    blocks = torch.ones(bs, dtype=torch.long)
    offs = torch.arange(bs)
    for fmt in ("cpu_kt_v", "cpu_amx", "kv_concat"):
        conn = VLLMPagedConnector(
            LMCacheConfig(chunk_size=bs),
            md,
            EngineInfo(name="vllm", device="cpu", kv_caches=[scratch]),
            {"kv_format": fmt},
        )
        got = gather_layer(fmt, conn.cache.caches[0], conn.cache.head_size_k, blocks, offs)
        if torch.equal(got, want):
            return fmt
    raise KVLayoutError(
        f"vLLM's CPU attention (isa={isa!r}) writes KV blocks in a format lmcache does not know "
        f"(cache {tuple(cache.shape)} {cache.dtype}); neither 'cpu_kt_v' (K transposed then V "
        "per block and head), 'cpu_amx' nor 'kv_concat' matched. Run without the connector or use a "
        "block size / dtype that selects the 'vec' kernels."
    )
