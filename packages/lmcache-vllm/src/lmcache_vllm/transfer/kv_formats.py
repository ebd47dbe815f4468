# SPDX-License-Identifier: Apache-2.0
"""vLLM block formats, token by token: one layer's gather/scatter between the paged cache and
canonical rows ``[num_tokens, kv_width]`` (all K heads, then all V heads).

``cache`` is one layer as vLLM hands it: ``[num_blocks, num_kv_heads, block_size, C]`` for
``kv_concat`` and ``cpu_kt_v``, ``[num_blocks, block_size, latent]`` for ``mla`` (see
:mod:`lmcache_vllm.transfer.paged_connector` for what each format means). ``blocks`` and ``offs``
are ``[num_tokens]`` int64 on the cache's device. These are the reference the fast paths are tested
against, and the path for tokens the fast paths do not cover. This module never imports vLLM.
"""

from __future__ import annotations

import torch

__all__ = [
    "AMX_TILE",
    "KV_FORMATS",
    "amx_views",
    "describe",
    "gather_layer",
    "kt_v_views",
    "scatter_layer",
]

KV_FORMATS = ("kv_concat", "cpu_kt_v", "cpu_amx", "mla")
"""Block formats :class:`~lmcache_vllm.transfer.paged_connector.VLLMPagedConnector` understands."""


def describe(t: torch.Tensor) -> str:
    """``shape=... strides=... dtype=... device=...`` of ``t``, for error messages."""
    return f"shape={tuple(t.shape)} strides={tuple(t.stride())} dtype={t.dtype} device={t.device}"


def kt_v_views(cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cpu_kt_v`` layer ``[B, H, bs, 2 * head]`` -> K^T ``[B, H, head, bs]`` and V
    ``[B, H, bs, head]`` views (each ``[b, h]`` run is K^T then V)."""
    bs = cache.shape[2]
    flat = cache.flatten(2)  # [B, H, 2 * bs * head]
    kt = flat[:, :, : head_size * bs].unflatten(2, (head_size, bs))  # type: ignore[no-untyped-call]
    vv = flat[:, :, head_size * bs :].unflatten(2, (bs, head_size))  # type: ignore[no-untyped-call]
    return kt, vv


AMX_TILE = 16
"""Rows of an AMX tile in vLLM's ``cpu_amx`` block format (16 tokens of K, 16 dims of V)."""


def amx_views(cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cpu_amx`` layer ``[B, H, bs, 2 * head]`` -> K ``[B, H, bs/16, head/2, 16, 2]`` and V
    ``[B, H, head/16, bs/2, 16, 2]`` views.

    vLLM's AMX CPU attention (bf16, block size a multiple of 32) keeps each ``[b, h]`` run as K
    then V, both VNNI-packed in pairs: ``K[t, d]`` at ``[t // 16, d // 2, t % 16, d % 2]`` and
    ``V[t, d]`` at ``[d // 16, t // 2, d % 16, t % 2]``.
    """
    bsz = cache.shape[2]
    t = AMX_TILE
    flat = cache.flatten(2)  # [B, H, 2 * bs * head]
    k = flat[:, :, : head_size * bsz].unflatten(2, (bsz // t, head_size // 2, t, 2))  # type: ignore[no-untyped-call]
    v = flat[:, :, head_size * bsz :].unflatten(2, (head_size // t, bsz // 2, t, 2))  # type: ignore[no-untyped-call]
    return k, v


def gather_layer(
    fmt: str,
    cache: torch.Tensor,
    head_size_k: int,
    blocks: torch.Tensor,
    offs: torch.Tensor,
) -> torch.Tensor:
    """KV of the tokens at ``(blocks, offs)`` of one layer as ``[num_tokens, kv_width]``."""
    n = blocks.numel()
    if fmt == "mla":
        return cache[blocks, offs]
    if fmt == "kv_concat":
        x = cache[blocks, :, offs, :]  # [n, heads, hk + hv]
        k = x[:, :, :head_size_k].reshape(n, -1)
        v = x[:, :, head_size_k:].reshape(n, -1)
        return torch.cat((k, v), dim=1)
    if fmt == "cpu_amx":
        ka, va = amx_views(cache, head_size_k)
        k = ka[blocks, :, offs // AMX_TILE, :, offs % AMX_TILE, :]  # [n, H, hs/2, 2]
        v = va[blocks, :, :, offs // 2, :, offs % 2]  # [n, H, hs/16, 16]
        return torch.cat((k.reshape(n, -1), v.reshape(n, -1)), dim=1)
    kt, vv = kt_v_views(cache, head_size_k)
    k = kt[blocks, :, :, offs]  # [n, H, hs]
    v = vv[blocks, :, offs, :]  # [n, H, hs]
    return torch.cat((k.reshape(n, -1), v.reshape(n, -1)), dim=1)


def scatter_layer(
    fmt: str,
    cache: torch.Tensor,
    num_kv_heads: int,
    head_size_k: int,
    head_size_v: int,
    blocks: torch.Tensor,
    offs: torch.Tensor,
    src: torch.Tensor,
) -> None:
    """Write ``src`` ``[num_tokens, kv_width]`` into one layer's slots ``(blocks, offs)``."""
    n = blocks.numel()
    if fmt == "mla":
        cache[blocks, offs] = src
        return
    k = src[:, : num_kv_heads * head_size_k].reshape(n, num_kv_heads, head_size_k)
    v = src[:, num_kv_heads * head_size_k :].reshape(n, num_kv_heads, head_size_v)
    if fmt == "kv_concat":
        cache[blocks, :, offs, :] = torch.cat((k, v), dim=2)
        return
    if fmt == "cpu_amx":
        ka, va = amx_views(cache, head_size_k)
        ka[blocks, :, offs // AMX_TILE, :, offs % AMX_TILE, :] = k.unflatten(-1, (-1, 2))  # type: ignore[no-untyped-call]
        va[blocks, :, :, offs // 2, :, offs % 2] = v.unflatten(-1, (-1, AMX_TILE))  # type: ignore[no-untyped-call]
        return
    kt, vv = kt_v_views(cache, head_size_k)
    kt[blocks, :, :, offs] = k
    vv[blocks, :, offs, :] = v
