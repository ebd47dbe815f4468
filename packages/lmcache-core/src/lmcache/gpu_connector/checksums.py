# SPDX-License-Identifier: Apache-2.0
"""Chunk checksums that a connector computes on the device, handed back to the cache engine.

The checksum is ``lmcache-mix64-sum`` (:mod:`lmcache.gpu_ops._ref` defines it). A store
returns :class:`StoreChecksums`: the sum of each chunk's bytes as the device wrote them to the
host. The engine keeps each sum with the chunk's bytes (``MemoryLease.checksum``). A load
returns :class:`LoadChecks`: for each chunk, either whether its staged bytes matched the
expected sum before they were scattered, or the sum of the layers this call moved. Both hold
pinned host tensors that the device fills. Read them only after the transfer completed
(``synchronize()``, or the event the caller waits on for a deferred store).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from lmcache.gpu_ops._checks import check_chunk_offsets
from lmcache.gpu_ops.mix64sum import signed64, unsigned64

__all__ = [
    "LoadChecks",
    "StoreChecksums",
    "expected_sums",
    "match_sums",
    "expected_part",
    "pack_index",
    "split_index",
    "staged_tokens",
]


class StoreChecksums:
    """The checksums of a store's chunks, in the order of the chunks given to ``from_gpu``.

    Args:
        host: ``[num_chunks]`` int64 host tensor that the device fills.
    """

    def __init__(self, host: torch.Tensor) -> None:
        self._host = host
        self._values: list[int] | None = None

    def values(self) -> list[int]:
        """The unsigned sums; call once the store's copies are complete (read once, then kept:
        each store of a batch reads its part)."""
        if self._values is None:
            self._values = [unsigned64(v) for v in self._host.tolist()]
        return self._values


class LoadChecks:
    """What a load checked of its chunks on the device.

    Args:
        chunks: Positions, in the chunk list given to the connector, of the chunks checked.
        ok: ``[len(chunks)]`` bool host tensor: the staged bytes matched the expected sum, and
            only matching chunks were scattered. ``None`` when ``sums`` is given.
        sums: ``[len(chunks)]`` int64 host tensor: the sum of the layers this call moved of
            each chunk (the caller adds the calls' sums and compares them with the expected
            sum once every layer has moved). ``None`` when ``ok`` is given.
        layers: The layers this call moved.
    """

    def __init__(
        self,
        chunks: Sequence[int],
        *,
        ok: torch.Tensor | None = None,
        sums: torch.Tensor | None = None,
        layers: range = range(0),
    ) -> None:
        if (ok is None) == (sums is None):
            raise ValueError("LoadChecks: expected exactly one of ok= and sums=.")
        self.chunks = list(chunks)
        self.layers = layers
        self._ok = ok
        self._sums = sums

    @property
    def verified(self) -> bool:
        """Whether the chunks were verified before the scatter (``ok`` flags)."""
        return self._ok is not None

    def ok(self) -> list[bool]:
        """Per checked chunk, whether it matched (verified loads only)."""
        if self._ok is None:
            raise ValueError("LoadChecks.ok(): this load returned partial sums, not verdicts.")
        return [bool(v) for v in self._ok.tolist()]

    def sums(self) -> list[int]:
        """Per checked chunk, the unsigned sum of the layers moved (partial-sum loads only)."""
        if self._sums is None:
            raise ValueError("LoadChecks.sums(): this load was verified; read ok() instead.")
        return [unsigned64(v) for v in self._sums.tolist()]


def expected_sums(checksums: Sequence[int | None]) -> list[int]:
    """The stored sums of chunks packed for :func:`match_sums`: ``[2 * len(checksums)]`` int64
    values, each chunk's sum as int64 bits (0 without one), then a has-a-sum flag each."""
    return [*(signed64(c) if c is not None else 0 for c in checksums)] + [
        int(c is not None) for c in checksums
    ]


def match_sums(sums: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per chunk, whether ``sums`` (``[k]`` int64, on the device) equals the stored sum, or the
    chunk has none; ``expected`` is :func:`expected_sums` of the ``k`` chunks, on the same device.
    """
    k = sums.numel()
    return (sums == expected[:k]) | (expected[k:] == 0)


def expected_part(expected: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """The :func:`expected_sums` of chunks ``[a, b)`` out of ``expected``, those of all of them."""
    k = expected.numel() // 2
    return expected.view(2, k)[:, a:b].reshape(-1)


class TokenSpan(Protocol):
    """A chunk's tokens ``[start, end)`` of its request (a ``ChunkTransfer`` is one)."""

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...


def staged_tokens(
    chunks: Sequence[TokenSpan], slot_mapping: torch.Tensor, skip: int
) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """The tokens a kernel transfer stages, and their slots, for :func:`pack_index`.

    A chunk the engine holds whole (``end <= skip``) is not staged. The tokens a staged chunk
    shares with the engine are staged (they count in its sum) but never written. Built with
    numpy over all tokens at once: per-chunk torch ops cost milliseconds on a 16k request.

    Returns:
        ``(positions, counts, tokens, slots)``: the position of each staged chunk in
        ``chunks``, its token count, the request index of every staged token (int64), and
        that token's slot from ``slot_mapping`` (a host int64 copy), ``-1`` before ``skip``.
        The caller checks the slots of the tokens from ``skip`` on.
    """
    positions = [i for i, c in enumerate(chunks) if c.end > skip]
    starts = np.array([chunks[i].start for i in positions], dtype=np.int64)
    ends = np.array([chunks[i].end for i in positions], dtype=np.int64)
    counts = ends - starts
    offsets = np.zeros(len(positions) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    chunk_of = np.repeat(np.arange(len(positions), dtype=np.int64), counts)
    tokens = starts[chunk_of] + np.arange(int(offsets[-1]), dtype=np.int64) - offsets[:-1][chunk_of]
    if positions and bool(np.all(starts[1:] == ends[:-1])):  # consecutive chunks: one slice
        slots = slot_mapping[int(starts[0]) : int(ends[-1])].to("cpu", torch.int64).numpy()
    else:
        slots = slot_mapping.to("cpu", torch.int64).numpy()[tokens]
    slots = slots.copy()  # never a view of the caller's slot mapping
    slots[tokens < skip] = -1
    return positions, counts, tokens, slots


def pack_index(
    counts: Sequence[int], slots: torch.Tensor | np.ndarray, checksums: Sequence[int | None]
) -> torch.Tensor:
    """The host side of a kernel transfer's device index, as one int64 tensor to upload at once.

    It holds the ``[k + 1]`` staging token offsets of ``k`` chunks of ``counts`` tokens, the
    ``[total]`` engine ``slots`` of the staging tokens, the ``[total]`` chunk of each staging
    token, then :func:`expected_sums` of the chunks' ``checksums``. Built with numpy over all
    tokens at once: a loop of small torch ops per chunk costs milliseconds on a 16k request.
    :func:`split_index` cuts the uploaded copy back into its four parts. The offsets are
    checked here, on the host (the kernels trust a device tensor of offsets).

    Raises:
        ValueError: a count is negative, or the counts do not add up to ``len(slots)``.
    """
    n = np.asarray(counts, dtype=np.int64)
    offsets = np.zeros(len(n) + 1, dtype=np.int64)
    np.cumsum(n, out=offsets[1:])
    host = slots.to(torch.int64).numpy() if isinstance(slots, torch.Tensor) else slots
    check_chunk_offsets("pack_index", offsets.tolist(), len(host))
    chunk_of = np.repeat(np.arange(len(n), dtype=np.int64), n)
    expected = np.asarray(expected_sums(checksums), dtype=np.int64)
    return torch.from_numpy(
        np.concatenate([offsets, np.asarray(host, dtype=np.int64), chunk_of, expected])
    )


def split_index(
    index: torch.Tensor, k: int, total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The offsets, slots, chunk of each token and expected sums of a :func:`pack_index` tensor
    (``k`` chunks, ``total`` tokens), as views of it."""
    a = k + 1
    return index[:a], index[a : a + total], index[a + total : a + 2 * total], index[a + 2 * total :]
