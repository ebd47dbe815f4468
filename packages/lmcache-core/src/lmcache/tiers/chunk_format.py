# SPDX-License-Identifier: Apache-2.0
"""The byte format of a chunk outside process memory (disk files, Redis/Valkey values).

A stored chunk is a fixed :data:`HEADER_BYTES`-byte header followed by the chunk's raw bytes
(``[num_layers, num_tokens, kv_width]`` of ``dtype``, C order). No pickle, no ``torch.load``:
reading a chunk is a ``struct`` unpack and a copy into a host buffer.

Header (little-endian, then zero padding up to :data:`HEADER_BYTES`, which keeps the payload
4 KiB-aligned in a file for ``O_DIRECT`` reads)::

    magic       4s   b"LMCK"
    version     H    1, or 2 when the header names the chunk's parent
    reserved    H    0
    key         16s  the chunk key (lmcache.keys.chunk_keys)
    fingerprint 16s  xxh3-128 of the storing engine's metadata fingerprint
    num_layers  I
    num_tokens  I
    kv_width    I
    dtype       16s  torch dtype name, ASCII, NUL-padded ("bfloat16")
    nbytes      Q    payload length
    checksum    Q    lmcache.tiers.tensor_checksum of the payload
    parent      16s  version 2 only: the previous chunk's key in the chunk's key chain
    header_sum  Q    xxh3-64 of every field above

Version 2 differs from version 1 only by the ``parent`` field, which lets a tier that chooses
its own victims (the disk tier) rebuild its eviction order after a restart: a chunk whose parent
is gone is worthless, since a lookup stops at the first missing chunk. A chunk without a known
parent (a chain's first chunk, or a tier that does not track parents, such as Redis) is written
as version 1, byte for byte what lmcache wrote before version 2, so readers of either version
read it. A reader of version 1 only rejects a version-2 header (``CorruptChunk``: a miss, never
a misread); this one reads both.

:func:`verify_chunk` checks everything a reader must check before a connector sees the bytes:
magic, version, header checksum, key, fingerprint, geometry, dtype, length and payload checksum.
Any difference raises :class:`CorruptChunk`; tiers turn it into a miss and delete the entry.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import xxhash

from lmcache.errors import CorruptChunk

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "READ_VERSIONS",
    "ChunkHeader",
    "CorruptChunk",
    "fingerprint_digest",
    "verify_chunk",
]

MAGIC = b"LMCK"
#: The newest version written (2: with a parent); a chunk without a parent is written as 1.
FORMAT_VERSION = 2
#: The versions :meth:`ChunkHeader.decode` reads.
READ_VERSIONS = (1, 2)
HEADER_BYTES = 4096
_FIELDS = struct.Struct("<4sHH16s16sIII16sQQ")
_PARENT = struct.Struct("<16s")
_SUM = struct.Struct("<Q")
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def fingerprint_digest(fingerprint: bytes) -> bytes:
    """The 16-byte digest of a metadata fingerprint that headers and remote key names carry."""
    return xxhash.xxh3_128_digest(bytes(fingerprint))


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) != dtype:
        raise ValueError(
            f"chunk_format: dtype {dtype} cannot be stored; expected one of {sorted(_DTYPES)}."
        )
    return name


@dataclass(frozen=True)
class ChunkHeader:
    """What a stored chunk says about itself.

    Attributes:
        key: The 16-byte chunk key.
        fingerprint: :func:`fingerprint_digest` of the storing engine's metadata fingerprint.
        shape: ``(num_layers, num_tokens, kv_width)``.
        dtype: Element type of the payload.
        nbytes: Payload length in bytes.
        checksum: :func:`lmcache.tiers.tensor_checksum` of the payload.
        parent: The previous chunk's key in the chunk's key chain, or ``None`` (a chain's first
            chunk, or unknown); a header with a parent is format version 2, one without is 1.
    """

    key: bytes
    fingerprint: bytes
    shape: tuple[int, int, int]
    dtype: torch.dtype
    nbytes: int
    checksum: int
    parent: bytes | None = None

    @property
    def version(self) -> int:
        """The format version :meth:`encode` writes: 2 with a parent, else 1."""
        return 1 if self.parent is None else 2

    def encode(self) -> bytes:
        """The :data:`HEADER_BYTES`-byte header.

        Raises:
            ValueError: a key, fingerprint or parent that is not 16 bytes, or an unsupported
                dtype.
        """
        if len(self.key) != 16 or len(self.fingerprint) != 16:
            raise ValueError(
                f"ChunkHeader: key and fingerprint must be 16 bytes, found {len(self.key)} and "
                f"{len(self.fingerprint)}; pass lmcache.keys.chunk_keys output and "
                "fingerprint_digest(metadata.fingerprint())."
            )
        if self.parent is not None and len(self.parent) != 16:
            raise ValueError(
                f"ChunkHeader: parent must be a 16-byte chunk key or None, found "
                f"{len(self.parent)} bytes; pass the previous lmcache.keys.chunk_keys entry."
            )
        fields = _FIELDS.pack(
            MAGIC,
            self.version,
            0,
            self.key,
            self.fingerprint,
            *self.shape,
            _dtype_name(self.dtype).encode("ascii"),
            self.nbytes,
            self.checksum,
        )
        if self.parent is not None:
            fields += _PARENT.pack(self.parent)
        head = fields + _SUM.pack(xxhash.xxh3_64_intdigest(fields))
        return head + bytes(HEADER_BYTES - len(head))

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ChunkHeader:
        """Parse a header (the first :data:`HEADER_BYTES` bytes of a stored chunk, or more).

        Raises:
            CorruptChunk: too short, wrong magic or version, the header checksum differs, or
                the padding up to :data:`HEADER_BYTES` (when given) is not zero.
        """
        need = _FIELDS.size + _SUM.size
        if len(data) < need:
            raise CorruptChunk(f"header truncated: {len(data)} bytes, expected >= {need}")
        head = bytes(data[: _FIELDS.size])
        (magic, version, _, key, fingerprint, layers, tokens, width, dtype, nbytes, checksum) = (
            _FIELDS.unpack(head)
        )
        if magic != MAGIC:
            raise CorruptChunk(f"bad magic {magic!r}, expected {MAGIC!r}")
        if version not in READ_VERSIONS:
            raise CorruptChunk(
                f"format version {version}, this lmcache reads versions {READ_VERSIONS}"
            )
        parent: bytes | None = None
        fields_end = _FIELDS.size
        if version == 2:
            fields_end += _PARENT.size
            need += _PARENT.size
            if len(data) < need:
                raise CorruptChunk(f"header truncated: {len(data)} bytes, expected >= {need}")
            (parent,) = _PARENT.unpack(bytes(data[_FIELDS.size : fields_end]))
        fields = bytes(data[:fields_end])
        (found_sum,) = _SUM.unpack(bytes(data[fields_end:need]))
        if found_sum != xxhash.xxh3_64_intdigest(fields):
            raise CorruptChunk("header checksum mismatch")
        if len(data) >= HEADER_BYTES and bytes(data[need:HEADER_BYTES]) != bytes(
            HEADER_BYTES - need
        ):
            raise CorruptChunk("header padding is not zero")
        name = dtype.rstrip(b"\0").decode("ascii", "replace")
        if name not in _DTYPES:
            raise CorruptChunk(f"unknown dtype {name!r}")
        shape = (layers, tokens, width)
        return cls(key, fingerprint, shape, _DTYPES[name], nbytes, checksum, parent)


def verify_chunk(
    header: ChunkHeader,
    payload: torch.Tensor | None,
    *,
    key: bytes,
    fingerprint: bytes,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
) -> None:
    """Check a read chunk against what the reader asked for, before anyone uses its bytes.

    Args:
        header: The decoded header.
        payload: The payload as read (a contiguous CPU tensor of any dtype), or ``None`` to check
            only the header (e.g. before reading the payload into place).
        key: The key that was looked up.
        fingerprint: :func:`fingerprint_digest` of the reader's metadata fingerprint.
        shape: The chunk shape the reader expects.
        dtype: The dtype the reader expects.

    Raises:
        CorruptChunk: naming the first field that differs.
    """
    if header.key != key:
        raise CorruptChunk(f"entry holds key {header.key.hex()}, expected {key.hex()}")
    if header.fingerprint != fingerprint:
        raise CorruptChunk(
            f"entry was stored by another model/geometry/rank (fingerprint "
            f"{header.fingerprint.hex()}, expected {fingerprint.hex()})"
        )
    if header.shape != tuple(shape) or header.dtype != dtype:
        raise CorruptChunk(
            f"entry has shape {header.shape} {header.dtype}, expected {tuple(shape)} {dtype}"
        )
    expected_nbytes = shape[0] * shape[1] * shape[2] * torch.empty((), dtype=dtype).element_size()
    if header.nbytes != expected_nbytes:
        raise CorruptChunk(f"entry says {header.nbytes} payload bytes, expected {expected_nbytes}")
    if payload is None:
        return
    found_bytes = payload.numel() * payload.element_size()
    if found_bytes != header.nbytes:
        raise CorruptChunk(f"payload is {found_bytes} bytes, header says {header.nbytes}")
    from lmcache.tiers.cpu_tier import tensor_checksum

    found = tensor_checksum(payload)
    if found != header.checksum:
        raise CorruptChunk(
            f"payload checksum {found:#018x} differs from the stored {header.checksum:#018x}"
        )
