# SPDX-License-Identifier: Apache-2.0
"""The chunk checksum ``lmcache-mix64-sum``: its definition, in plain Python and in pure torch.

Version 1. A chunk's bytes are read as little-endian 64-bit
words ``w_1 .. w_m`` (the last one zero-padded) and

    checksum = (mix64(nbytes) + sum_i mix64(w_i XOR (i * 0x9E3779B97F4A7C15))) mod 2^64

where ``mix64`` is splitmix64's finalizer (``x ^= x >> 30; x *= 0xBF58476D1CE4E5B9; x ^= x >> 27;
x *= 0x94D049BB133111EB; x ^= x >> 31``), a bijection of 64-bit words. Because the terms add, the
kernels compute it in the pass that moves the bytes, split over warps, blocks and layer calls
(``gather_kv(..., checksums)`` adds the terms of the layers it moves; the call that moves layer 0
adds the length term). A change confined to one word (any single flipped bit) always changes the
sum, since ``mix64`` is a bijection; words that move to another position, and a chunk
overwritten by another chunk's different bytes, change it except with probability about
``2^-64``. It is an integrity check against corruption and misplacement, not a MAC: it is
linear in its terms and an adversary can forge it. :func:`chunk_checksum` computes it for a
host (or device) tensor, so the CPU can verify what a kernel computed. Values are stored as
int64 (the same 64 bits, signed).
"""

from __future__ import annotations

import torch

__all__ = [
    "CHECKSUM_NAME",
    "CHECKSUM_VERSION",
    "bytes_of",
    "chunk_checksum",
    "chunk_checksum_py",
    "mix64",
    "signed64",
    "unsigned64",
    "word_sum",
]

CHECKSUM_NAME = "lmcache-mix64-sum"
"""Name of the chunk checksum defined in this module's docstring."""

CHECKSUM_VERSION = 1
"""Version of :data:`CHECKSUM_NAME`; a change of definition bumps it."""

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def signed64(x: int) -> int:
    """The int64 with the bits of unsigned 64-bit ``x``."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def unsigned64(x: int) -> int:
    """The unsigned 64-bit value of ``x``'s low 64 bits (an int64 checksum word, or a sum)."""
    return x & _MASK64


def mix64(x: int) -> int:
    """splitmix64's finalizer of unsigned 64-bit ``x`` (Python ints, exact)."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * _MUL1) & _MASK64
    x ^= x >> 27
    x = (x * _MUL2) & _MASK64
    return x ^ (x >> 31)


def chunk_checksum_py(data: bytes) -> int:
    """The checksum of ``data`` in plain Python (slow; the definition, for tests)."""
    total = mix64(len(data))
    padded = data + bytes(-len(data) % 8)
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        total += mix64(w ^ (((i + 1) * _GOLDEN) & _MASK64))
    return total & _MASK64


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64_t(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix64` of every int64 element (two's-complement wrap-around)."""
    x = x ^ _srl(x, 30)
    x = x * signed64(_MUL1)
    x = x ^ _srl(x, 27)
    x = x * signed64(_MUL2)
    return x ^ _srl(x, 31)


def word_sum(data: torch.Tensor, first: int) -> int:
    """``sum_i mix64(w_i XOR (i * golden)) mod 2^64`` over the zero-padded little-endian words of
    1-D uint8 ``data``, numbered from ``first`` (1-based index of the first word)."""
    n = data.numel()
    if n == 0:
        return 0
    pad = -n % 8
    if pad or data.storage_offset() % 8:  # view(int64) needs whole, aligned words
        data = torch.cat((data, data.new_zeros(pad)))
    words = data.view(torch.int64)
    index = torch.arange(first, first + words.numel(), dtype=torch.int64, device=data.device)
    x = _mix64_t(words ^ (index * signed64(_GOLDEN)))
    low = int((x & 0xFFFFFFFF).sum())  # exact: each < 2^32, fewer than 2^31 words
    high = int(_srl(x, 32).sum())
    return (low + (high << 32)) & _MASK64


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view."""
    if not t.is_contiguous():
        raise ValueError(
            f"chunk_checksum: expected a contiguous tensor, found shape {list(t.shape)} strides "
            f"{list(t.stride())}; call .contiguous() first."
        )
    return t.reshape(-1).view(torch.uint8)


def chunk_checksum(t: torch.Tensor) -> int:
    """The checksum (module docstring) of a contiguous tensor's bytes, as an unsigned int.

    Args:
        t: A contiguous tensor of any dtype and device, e.g. a host chunk
            ``[num_layers, num_tokens, kv_width]``.

    Returns:
        The checksum, ``0 <= value < 2**64`` (a kernel's int64 output ``v`` is ``v % 2**64``).

    Raises:
        ValueError: ``t`` is not contiguous.
    """
    data = bytes_of(t)
    return (mix64(data.numel()) + word_sum(data, 1)) & _MASK64
