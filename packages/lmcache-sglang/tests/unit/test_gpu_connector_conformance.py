# SPDX-License-Identifier: Apache-2.0
"""Core's connector conformance suite on SGLang's KV pool layouts (CPU tensors).

Each class builds the tensors the way SGLang allocates them (``MHATokenToKVPool``'s per-layer
``[slots, heads, dim]`` K and V, ``MLATokenToKVPool``'s ``[slots, 1, latent]``, and the paged
host layouts) and an oracle that reads them independently.
"""

from __future__ import annotations

import torch

from lmcache.gpu_connector import EngineInfo
from lmcache.testing.conformance import GPUConnectorConformance, default_metadata_cases

PAGE = 4


def _mha_cases():
    return [m for m in default_metadata_cases() if not m.use_mla]


def _mla_cases():
    return [m for m in default_metadata_cases() if m.use_mla]


def _canonical(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[L, T, H, hk]`` + ``[L, T, H, hv]`` -> ``[L, T, H*hk + H*hv]``."""
    return torch.cat((k.flatten(2), v.flatten(2)), dim=2)


class _SGLangBase(GPUConnectorConformance):
    def _num_slots(self, metadata) -> int:
        # SGLang reserves slot 0..page_size-1 (padding page); give a spare page too.
        return (self.required_slots(metadata) // PAGE + 2) * PAGE

    def valid_slots(self, engine):
        return torch.arange(PAGE, engine.extra["num_slots"], dtype=torch.long)


class TestSGLangMHA(_SGLangBase):
    """MHATokenToKVPool: per layer K [slots, H, hk] and V [slots, H, hv]."""

    def metadata_cases(self):
        return _mha_cases()

    def make_engine(self, metadata):
        n = self._num_slots(metadata)
        shape = (metadata.num_layers, n, metadata.num_kv_heads)
        k = torch.randn(*shape, metadata.head_size_k).to(metadata.kv_dtype)
        v = torch.randn(*shape, metadata.head_size_v).to(metadata.kv_dtype)
        return EngineInfo(
            name="sglang",
            device="cpu",
            kv_caches=[(k[i], v[i]) for i in range(metadata.num_layers)],
            extra={"num_slots": n, "k": k, "v": v},
        )

    def read_token_kv(self, engine, slots):
        s = slots.cpu()
        return _canonical(engine.extra["k"][:, s], engine.extra["v"][:, s])


class TestSGLangHostPageFirst(_SGLangBase):
    """HiCache ``page_first`` host layout: [2, slots, layers, H, D], strided per-layer views."""

    def metadata_cases(self):
        return [m for m in _mha_cases() if m.head_size_k == m.head_size_v]

    def make_engine(self, metadata):
        n = self._num_slots(metadata)
        buf = torch.randn(
            2, n, metadata.num_layers, metadata.num_kv_heads, metadata.head_size_k
        ).to(metadata.kv_dtype)
        return EngineInfo(
            name="sglang",
            device="cpu",
            kv_caches=[(buf[0, :, i], buf[1, :, i]) for i in range(metadata.num_layers)],
            extra={"num_slots": n, "buf": buf},
        )

    def read_token_kv(self, engine, slots):
        buf = engine.extra["buf"].transpose(1, 2)  # [2, L, slots, H, D]
        s = slots.cpu()
        return _canonical(buf[0][:, s], buf[1][:, s])


class TestSGLangPagedNHD(_SGLangBase):
    """HiCache ``page_first_direct``: [2, pages, layers, page_size, H, D] (paged NHD per layer)."""

    def metadata_cases(self):
        return [m for m in _mha_cases() if m.head_size_k == m.head_size_v]

    def layout_hints(self, metadata):
        return {"kv_layout": "paged_nhd", "page_size": PAGE}

    def make_engine(self, metadata):
        n = self._num_slots(metadata)
        buf = torch.randn(
            2, n // PAGE, metadata.num_layers, PAGE, metadata.num_kv_heads, metadata.head_size_k
        ).to(metadata.kv_dtype)
        return EngineInfo(
            name="sglang",
            device="cpu",
            kv_caches=[(buf[0, :, i], buf[1, :, i]) for i in range(metadata.num_layers)],
            extra={"num_slots": n, "buf": buf},
        )

    def read_token_kv(self, engine, slots):
        buf = engine.extra["buf"]
        _, p, L, ps, H, D = buf.shape
        tok = buf.permute(0, 2, 1, 3, 4, 5).reshape(2, L, p * ps, H, D)
        s = slots.cpu()
        return _canonical(tok[0][:, s], tok[1][:, s])


class TestSGLangPagedHND(_SGLangBase):
    """Paged HND pools: per layer K and V [pages, H, page_size, D]."""

    def metadata_cases(self):
        return _mha_cases()

    def layout_hints(self, metadata):
        return {"kv_layout": "paged_hnd", "page_size": PAGE}

    def make_engine(self, metadata):
        n = self._num_slots(metadata)
        shape = (metadata.num_layers, n // PAGE, metadata.num_kv_heads, PAGE)
        k = torch.randn(*shape, metadata.head_size_k).to(metadata.kv_dtype)
        v = torch.randn(*shape, metadata.head_size_v).to(metadata.kv_dtype)
        return EngineInfo(
            name="sglang",
            device="cpu",
            kv_caches=[(k[i], v[i]) for i in range(metadata.num_layers)],
            extra={"num_slots": n, "k": k, "v": v},
        )

    def read_token_kv(self, engine, slots):
        def tokens(t):
            L, P, H, ps, D = t.shape
            return t.permute(0, 1, 3, 2, 4).reshape(L, P * ps, H, D)

        s = slots.cpu()
        return _canonical(tokens(engine.extra["k"])[:, s], tokens(engine.extra["v"])[:, s])


class TestSGLangMLA(_SGLangBase):
    """MLATokenToKVPool: per layer one latent buffer [slots, 1, latent]."""

    def metadata_cases(self):
        return _mla_cases()

    def make_engine(self, metadata):
        n = self._num_slots(metadata)
        kv = torch.randn(metadata.num_layers, n, 1, metadata.head_size_k).to(metadata.kv_dtype)
        return EngineInfo(
            name="sglang",
            device="cpu",
            kv_caches=[kv[i] for i in range(metadata.num_layers)],
            extra={"num_slots": n, "kv": kv},
        )

    def read_token_kv(self, engine, slots):
        return engine.extra["kv"][:, slots.cpu(), 0]
