# SPDX-License-Identifier: Apache-2.0
"""Host checksums of chunk bytes: the xxh3-64 sums the CPU tier keeps and verifies, and the lower
tiers store in their entries' headers.

:func:`tensor_checksum` defines the sum. :func:`batch_checksums` (behind
:meth:`lmcache.tiers.CPUTier.checksums`) takes the sums of a batch of chunks or pages in one pass.

Bytes are hashed on the calling thread, in place, in pieces of :data:`GIL_PIECE_BYTES` fed to
one streaming xxh3 state per slice (the same digest as hashing the slice at once). xxhash lets go
of the GIL for larger inputs, and getting it back waits for the interpreter's switch interval
(5 ms) whenever another Python thread is busy: an engine's scheduler loop always is. Hashing 128
pages of 2 MiB then took 0.7 s instead of 20 ms (SGLang's HiCache backup on an H100 host, and
reproduced on any host with one busy Python thread). In pieces that keep the GIL, the hashing
thread shares the interpreter at the switch interval like any Python code: 128 pages took 34-42
ms beside a busy thread. A pool of hashing threads would meet the same wait on every slice.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence

import torch
import xxhash

__all__ = ["CHECKSUM_SLICE_BYTES", "GIL_PIECE_BYTES", "batch_checksums", "tensor_checksum"]


#: Checksums hash a chunk in slices of this many bytes, then hash the digests.
CHECKSUM_SLICE_BYTES = 4 << 20

#: Bytes fed to xxhash per call: at most this much, it keeps the GIL (see the module docstring).
GIL_PIECE_BYTES = 64 << 10


def _byte_slices(tensor: torch.Tensor) -> list[memoryview]:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"tensor_checksum needs a contiguous CPU tensor, found device={tensor.device}, "
            f"contiguous={tensor.is_contiguous()}; pass a host chunk buffer (lease.tensor)."
        )
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return [memoryview(b"")]
    # The bytes in place, at a fraction of a numpy view's cost (a batch takes one per page). The
    # caller holds the tensor, and so its bytes, for as long as it hashes them.
    data = memoryview((ctypes.c_char * size).from_address(tensor.data_ptr()))
    step = CHECKSUM_SLICE_BYTES
    return [data[i : i + step] for i in range(0, size, step)] if size > step else [data]


def _digest(data: memoryview) -> int:
    """xxh3-64 of ``data``, fed in pieces during which xxhash keeps the GIL."""
    if len(data) <= GIL_PIECE_BYTES:
        return xxhash.xxh3_64_intdigest(data)
    state = xxhash.xxh3_64()
    update = state.update
    for i in range(0, len(data), GIL_PIECE_BYTES):
        update(data[i : i + GIL_PIECE_BYTES])
    return state.intdigest()


def _combine(digests: Sequence[int]) -> int:
    if len(digests) == 1:
        return digests[0]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


def tensor_checksum(tensor: torch.Tensor) -> int:
    """Checksum of a contiguous host tensor's bytes, read in place (no copy).

    The bytes are cut into slices of :data:`CHECKSUM_SLICE_BYTES`; the checksum is the xxh3-64 of
    the one slice, or the xxh3-64 of the slices' xxh3-64 digests (little-endian uint64) when there
    are several.

    Args:
        tensor: A contiguous CPU tensor of any dtype, e.g. a chunk ``[num_layers, num_tokens,
            kv_width]``.

    Raises:
        ValueError: the tensor is not on the CPU or not contiguous.
    """
    return _combine([_digest(s) for s in _byte_slices(tensor)])


def batch_checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """:func:`tensor_checksum` of each tensor, equal to it bit for bit, back to back on the
    calling thread.

    Raises:
        ValueError: a tensor is not a contiguous CPU tensor.
    """
    return [_combine([_digest(s) for s in _byte_slices(t)]) for t in tensors]
