# SPDX-License-Identifier: Apache-2.0
"""Host checksums of chunk bytes: the xxh3-64 sums the CPU tier keeps and verifies, and the lower
tiers store in their entries' headers.

:func:`tensor_checksum` defines the sum. :func:`batch_checksums` (behind
:meth:`lmcache.tiers.CPUTier.checksums`) takes the sums of a batch of chunks or pages in one pass,
and :func:`parallel_checksum` those of one large chunk.

Tensors of one slice (pages, small chunks) are hashed on the calling thread, back to back, over
views of their bytes in place: one hashing thread already runs at memory speed on a 2-core host
(two threads hash 32 MiB of pages no faster), while a pool costs a hand-off per page, and each may
wait up to the interpreter's switch interval (5 ms) while another Python thread runs (SGLang's
scheduler thread does while a request waits for its prefetch). xxhash releases the GIL while it
hashes more than 64 KiB, so other threads run meanwhile.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

__all__ = ["CHECKSUM_SLICE_BYTES", "batch_checksums", "parallel_checksum", "tensor_checksum"]


#: Checksums hash a chunk in slices of this many bytes, then hash the digests.
CHECKSUM_SLICE_BYTES = 4 << 20


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
    return _combine([xxhash.xxh3_64_intdigest(s) for s in _byte_slices(tensor)])


_shared_lock = threading.Lock()
_shared_hasher: ThreadPoolExecutor | None = None
_WORKERS = min(8, os.cpu_count() or 1)


def _hasher() -> ThreadPoolExecutor:
    """The process-wide pool of up to 8 hashing threads (started on first use)."""
    global _shared_hasher
    with _shared_lock:
        if _shared_hasher is None:
            _shared_hasher = ThreadPoolExecutor(_WORKERS, thread_name_prefix="lmcache-verify")
        return _shared_hasher


def parallel_checksum(tensor: torch.Tensor) -> int:
    """:func:`tensor_checksum`, its slices hashed on up to 8 threads (a process-wide pool).

    For large chunks read from disk or Redis; equal to :func:`tensor_checksum` bit for bit.

    Raises:
        ValueError: the tensor is not on the CPU or not contiguous.
    """
    slices = _byte_slices(tensor)
    if len(slices) <= 1 or _WORKERS <= 1:
        return _combine([xxhash.xxh3_64_intdigest(s) for s in slices])
    return _combine(list(_hasher().map(xxhash.xxh3_64_intdigest, slices)))


def batch_checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """:func:`tensor_checksum` of each tensor, equal to it bit for bit.

    When every tensor is one slice (up to :data:`CHECKSUM_SLICE_BYTES`: pages, small chunks),
    they are hashed on the calling thread, back to back (see the module docstring). Otherwise
    the slices are hashed on the process-wide pool of :func:`parallel_checksum`.

    Raises:
        ValueError: a tensor is not a contiguous CPU tensor.
    """
    parts = [_byte_slices(t) for t in tensors]
    hash64 = xxhash.xxh3_64_intdigest
    if _WORKERS <= 1 or all(len(slices) == 1 for slices in parts):
        return [_combine([hash64(s) for s in slices]) for slices in parts]
    digests = list(_hasher().map(hash64, [s for slices in parts for s in slices]))
    out, start = [], 0
    for slices in parts:
        out.append(_combine(digests[start : start + len(slices)]))
        start += len(slices)
    return out
