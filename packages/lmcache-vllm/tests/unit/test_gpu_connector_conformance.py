# SPDX-License-Identifier: Apache-2.0
"""Core's connector conformance suite on vLLM's KV layouts, built on CPU tensors.

Each class builds the *physical* buffer the way vLLM allocates it and hands the connector the
logical per-layer views vLLM would; the oracle reads the physical buffer independently.
"""

from __future__ import annotations

import torch

from lmcache.gpu_connector import EngineInfo
from lmcache.testing.conformance import GPUConnectorConformance, default_metadata_cases

BLOCK = 4
NUM_BLOCKS = 12  # block 0 is vLLM's null block: never used


def _mha_cases(equal_heads_only: bool = False):
    cases = [m for m in default_metadata_cases() if not m.use_mla]
    if equal_heads_only:
        cases = [m for m in cases if m.head_size_k == m.head_size_v]
    return cases


def _canonical(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[L, T, H, hk]`` + ``[L, T, H, hv]`` -> ``[L, T, H*hk + H*hv]``."""
    return torch.cat((k.flatten(2), v.flatten(2)), dim=2)


class _VllmBase(GPUConnectorConformance):
    kv_format = "kv_concat"

    def valid_slots(self, engine):
        return torch.arange(BLOCK, NUM_BLOCKS * BLOCK, dtype=torch.long)

    def required_slots(self, metadata):
        return min(super().required_slots(metadata), (NUM_BLOCKS - 1) * BLOCK)

    def layout_hints(self, metadata):
        return {"kv_format": self.kv_format}

    def _engine(self, metadata, *seed):  # grow the cache when the suite asks for more slots
        return super()._engine(metadata, *seed)


def _num_blocks(self, metadata) -> int:
    return GPUConnectorConformance.required_slots(self, metadata) // BLOCK + 2


class TestVllmLBHNC(_VllmBase):
    """CPU-style physical order: [layers, blocks, heads, block_size, K||V]."""

    def metadata_cases(self):
        return _mha_cases()

    def make_engine(self, metadata):
        nb = _num_blocks(self, metadata)
        c = metadata.head_size_k + metadata.head_size_v
        phys = torch.randn(metadata.num_layers, nb, metadata.num_kv_heads, BLOCK, c).to(
            metadata.kv_dtype
        )
        return EngineInfo(
            name="vllm",
            device="cpu",
            kv_caches=[phys[i] for i in range(metadata.num_layers)],
            extra={"block_size": BLOCK, "phys": phys, "md": metadata},
        )

    def valid_slots(self, engine):
        return torch.arange(BLOCK, engine.extra["phys"].shape[1] * BLOCK, dtype=torch.long)

    def read_token_kv(self, engine, slots):
        phys, md = engine.extra["phys"], engine.extra["md"]
        L, B, H, N, C = phys.shape
        tok = phys.permute(0, 1, 3, 2, 4).reshape(L, B * N, H, C)[:, slots.cpu()]
        return _canonical(tok[..., : md.head_size_k], tok[..., md.head_size_k :])


class TestVllmLBNHC(TestVllmLBHNC):
    """CUDA FlashAttention physical order [layers, blocks, block_size, heads, K||V], seen
    through the logical [blocks, heads, block_size, C] view."""

    def make_engine(self, metadata):
        nb = _num_blocks(self, metadata)
        c = metadata.head_size_k + metadata.head_size_v
        phys = torch.randn(metadata.num_layers, nb, BLOCK, metadata.num_kv_heads, c).to(
            metadata.kv_dtype
        )
        views = [phys[i].permute(0, 2, 1, 3) for i in range(metadata.num_layers)]
        assert not views[0].is_contiguous()
        return EngineInfo(
            name="vllm",
            device="cpu",
            kv_caches=views,
            extra={"block_size": BLOCK, "phys": phys, "md": metadata},
        )

    def read_token_kv(self, engine, slots):
        phys, md = engine.extra["phys"], engine.extra["md"]
        L, B, N, H, C = phys.shape
        tok = phys.reshape(L, B * N, H, C)[:, slots.cpu()]
        return _canonical(tok[..., : md.head_size_k], tok[..., md.head_size_k :])


class TestVllmCpuKtV(TestVllmLBHNC):
    """vLLM's CPU attention block format: per (block, head) K^T [head, block_size] then V."""

    kv_format = "cpu_kt_v"

    def metadata_cases(self):
        return _mha_cases(equal_heads_only=True)

    def make_engine(self, metadata):
        nb = _num_blocks(self, metadata)
        hs = metadata.head_size_k
        phys = torch.randn(metadata.num_layers, nb, metadata.num_kv_heads, 2 * BLOCK * hs).to(
            metadata.kv_dtype
        )
        views = [
            phys[i].view(nb, metadata.num_kv_heads, BLOCK, 2 * hs)
            for i in range(metadata.num_layers)
        ]
        return EngineInfo(
            name="vllm",
            device="cpu",
            kv_caches=views,
            extra={"block_size": BLOCK, "phys": phys, "md": metadata},
        )

    def read_token_kv(self, engine, slots):
        phys, md = engine.extra["phys"], engine.extra["md"]
        L, B, H, _ = phys.shape
        hs, N = md.head_size_k, BLOCK
        k = phys[..., : hs * N].reshape(L, B, H, hs, N).permute(0, 1, 4, 2, 3)
        v = phys[..., hs * N :].reshape(L, B, H, N, hs).permute(0, 1, 3, 2, 4)
        k = k.reshape(L, B * N, H, hs)[:, slots.cpu()]
        v = v.reshape(L, B * N, H, hs)[:, slots.cpu()]
        return _canonical(k, v)


class TestVllmMLA(_VllmBase):
    """MLA: one latent per token, [blocks, block_size, latent] per layer."""

    kv_format = "mla"

    def metadata_cases(self):
        return [m for m in default_metadata_cases() if m.use_mla]

    def make_engine(self, metadata):
        nb = _num_blocks(self, metadata)
        phys = torch.randn(metadata.num_layers, nb, BLOCK, metadata.head_size_k).to(
            metadata.kv_dtype
        )
        return EngineInfo(
            name="vllm",
            device="cpu",
            kv_caches=[phys[i] for i in range(metadata.num_layers)],
            extra={"block_size": BLOCK, "phys": phys},
        )

    def valid_slots(self, engine):
        return torch.arange(BLOCK, engine.extra["phys"].shape[1] * BLOCK, dtype=torch.long)

    def read_token_kv(self, engine, slots):
        phys = engine.extra["phys"]
        L, B, N, D = phys.shape
        return phys.reshape(L, B * N, D)[:, slots.cpu()]


class TestVllmMLA4D(TestVllmMLA):
    """MLA through vLLM 0.32's standardised 4-D view [blocks, 1, block_size, latent]."""

    def make_engine(self, metadata):
        engine = super().make_engine(metadata)
        views = [t.unsqueeze(1) for t in engine.kv_caches]
        return EngineInfo(name="vllm", device="cpu", kv_caches=views, extra=engine.extra)
