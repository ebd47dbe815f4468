# SPDX-License-Identifier: Apache-2.0
"""A request cut into chunks: validated once, then a plain plan object.

:func:`plan_request` checks a request's tokens, mask and slot mapping and computes its chunk keys
(:func:`lmcache.keys.chunk_keys`); :class:`lmcache.cache_engine.LMCacheEngine` works from the
returned :class:`RequestPlan` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmcache.gpu_connector.interface import TransferSpec
from lmcache.keys import KeyChain, TokenIds, chunk_ranges

__all__ = ["ExtraKeys", "RequestPlan", "Tokens", "plan_request"]

#: Token ids of one request: a list or tuple of ints, or a 1-D integer numpy array or torch
#: tensor ``[num_tokens]``.
Tokens = TokenIds

#: Extra key material per chunk index, e.g. ``{chunk of an image's placeholders: image hash}``;
#: see :func:`lmcache.keys.chunk_keys`.
ExtraKeys = Mapping[int, bytes]


@dataclass(frozen=True)
class RequestPlan:
    """A request cut into chunks: ``keys[i]`` is the key of tokens ``ranges[i]``.

    Attributes:
        num_tokens: Tokens of the request.
        keys: One chunk key per chunk, in chain order (a :class:`~lmcache.keys.KeyChain` that
            computes them on first use for a lookup's plan).
        ranges: Half-open token range ``(start, end)`` of each chunk.
        first_chunk: First chunk after the mask's ``False`` prefix.
    """

    num_tokens: int
    keys: Sequence[bytes]
    ranges: list[tuple[int, int]]
    first_chunk: int


def plan_request(
    tokens: Tokens,
    mask: torch.Tensor | None,
    transfer: TransferSpec | None,
    *,
    chunk_size: int,
    fingerprint: bytes,
    salt: str,
    extra_keys: ExtraKeys | None = None,
    lazy: bool = False,
    known_keys: Sequence[bytes] = (),
) -> RequestPlan:
    """Validate a request and compute its chunk keys (``lazy``: on first use).

    Args:
        tokens: Token ids ``[num_tokens]``.
        mask: bool ``[num_tokens]`` whose ``False`` entries are a chunk-aligned prefix, or
            ``None``.
        transfer: The request's slots (``slot_mapping`` ``[num_tokens]``), or ``None``.
        chunk_size: Tokens per chunk.
        fingerprint: Seeds the key chain (``LMCacheMetadata.fingerprint()``).
        salt: The full cache salt.
        extra_keys: Extra key material per chunk index.
        lazy: Keys as a :class:`~lmcache.keys.KeyChain`, hashed (and their token ids checked)
            as far as they are read: for a lookup, which stops at its first missing chunk.
        known_keys: Keys of the leading chunks of exactly these tokens, fingerprint, salt and
            extra keys, computed before (e.g. by the lookup of the hit now loaded): not hashed
            again, and not checked (see :class:`~lmcache.keys.KeyChain`).

    Raises:
        ValueError: malformed tokens, mask, slot mapping or ``extra_keys``.
        TypeError: tokens or ``extra_keys`` of the wrong type.
    """
    if isinstance(tokens, torch.Tensor | np.ndarray) and tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D [num_tokens], found shape {tuple(tokens.shape)}")
    num_tokens = len(tokens)
    cs = chunk_size
    masked = 0
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 1 or mask.shape[0] != num_tokens:
            raise ValueError(
                f"mask must be a bool tensor [num_tokens={num_tokens}], found "
                f"{mask.dtype} {tuple(mask.shape)}."
            )
        mask = mask.cpu()
        masked = int((~mask).sum())
        if bool((~mask[masked:]).any()):
            raise ValueError(
                "mask's False entries must be a prefix (tokens to skip, then tokens to "
                f"transfer), found {masked} False entries not all at the start. Mask only a "
                "leading, chunk-aligned run of tokens."
            )
        if masked % cs != 0 and masked != num_tokens:
            raise ValueError(
                f"mask's False prefix must be a multiple of chunk_size={cs}, found {masked} "
                f"masked tokens. Round the skipped prefix down to a multiple of {cs}."
            )
    if transfer is not None:
        sm = transfer.slot_mapping
        if sm.dim() != 1 or sm.shape[0] != num_tokens:
            raise ValueError(
                f"transfer.slot_mapping must be [num_tokens={num_tokens}] (one slot per token "
                f"of the request), found shape {tuple(sm.shape)}."
            )
    chain = KeyChain(tokens, fingerprint, cs, salt=salt, extra_keys=extra_keys, known=known_keys)
    keys: Sequence[bytes] = chain if lazy else chain[:]
    ranges = chunk_ranges(num_tokens, cs)
    return RequestPlan(num_tokens, keys, ranges, -(-masked // cs))
