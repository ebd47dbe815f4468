# SPDX-License-Identifier: Apache-2.0
"""Pure functions from a request's metadata to what ``LMCacheEngine`` store/retrieve take."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache.gpu_connector import TransferSpec
from lmcache_vllm.connector_metadata import ReqMeta

__all__ = ["LoadOutcome", "load_outcome", "load_plan", "save_mask", "skip_mask", "slot_mapping"]


def slot_mapping(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Slot of each token ``[num_tokens]`` (``block_id * block_size + offset``), ``-1`` past the
    allocated blocks."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offs = torch.arange(block_size, dtype=torch.long)
    slots = (blocks[:, None] * block_size + offs[None, :]).flatten()
    if slots.numel() >= num_tokens:
        return slots[:num_tokens]
    pad = torch.full((num_tokens - slots.numel(),), -1, dtype=torch.long)
    return torch.cat((slots, pad))


def skip_mask(num_tokens: int, skip: int, chunk_size: int) -> torch.Tensor:
    """bool ``[num_tokens]``: ``False`` for the chunk-aligned prefix of ``skip`` tokens."""
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[: skip // chunk_size * chunk_size] = False
    return mask


def save_mask(num_tokens: int, skip: int, chunk_size: int) -> torch.Tensor | None:
    """A save's mask, or ``None`` (every chunk) when ``skip`` covers no whole chunk.

    ``None`` spares the engine building and checking a mask for most saves.
    """
    return skip_mask(num_tokens, skip, chunk_size) if skip >= chunk_size else None


def load_plan(
    req: ReqMeta, block_size: int, chunk_size: int
) -> tuple[list[int], torch.Tensor, TransferSpec, int] | None:
    """``(tokens, mask, transfer, n)`` for loading ``req``'s hit, or ``None`` when nothing lies
    beyond vLLM's own prefix. Keys need whole chunks, and nothing is written past the
    allocated blocks or below ``vllm_cached``."""
    load = req.load
    assert load is not None
    covered = len(req.block_ids) * block_size
    n = load.lmcache_hit
    if n > covered:
        n = min(load.load_end // chunk_size * chunk_size, covered)
    if n <= load.vllm_cached:
        return None
    transfer = TransferSpec(
        slot_mapping(req.block_ids, block_size, n), skip_tokens=load.vllm_cached
    )
    return req.token_ids[:n], skip_mask(n, load.vllm_cached, chunk_size), transfer, n


@dataclass(frozen=True)
class LoadOutcome:
    """What a load delivered of ``[vllm_cached, load_end)``: token counts, and the blocks from
    the first missing token on (vLLM recomputes them)."""

    expected: int
    loaded: int
    failed: int
    bad_blocks: list[int]


def load_outcome(req: ReqMeta, loaded: torch.Tensor | None, block_size: int) -> LoadOutcome:
    """Compare ``loaded`` (bool ``[num_tokens]`` from a retrieve, ``None`` when nothing was
    loaded) with what ``req`` promised to vLLM."""
    load = req.load
    assert load is not None
    lo, hi = load.vllm_cached, load.load_end
    ok = torch.zeros(hi - lo, dtype=torch.bool)
    if loaded is not None:
        have = loaded[lo : min(hi, loaded.numel())]
        ok[: have.numel()] = have
    missing = (~ok).nonzero()
    if missing.numel() == 0:
        return LoadOutcome(hi - lo, hi - lo, 0, [])
    first_bad = lo + int(missing[0])
    bad = req.block_ids[first_bad // block_size : -(-hi // block_size)]
    return LoadOutcome(hi - lo, int(ok.sum()), hi - first_bad, list(bad))
