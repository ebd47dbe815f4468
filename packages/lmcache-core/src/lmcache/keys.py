# SPDX-License-Identifier: Apache-2.0
"""Chunk keys: 128-bit hashes chained over token chunks (format ``lmcache-chunk-key-v1``).

Tokens are cut into chunks of ``chunk_size`` (the last one may be partial). Chunk ``i``'s key is::

    key[-1] = xxh3_128(b"lmcache-chunk-key-v1\\0" + fingerprint + b"\\0" + salt).digest()
    key[i]  = xxh3_128(key[i - 1] + tokens[i] as little-endian uint32).digest()

Per-chunk extra key material (``extra_keys``, e.g. the hashes of the multimodal items whose
placeholder tokens are in chunk ``i``) is folded into the chain before chunk ``i``'s tokens::

    prev    = xxh3_128(key[i - 1] + b"lmcache-chunk-extra-v1\\0" + extra[i]).digest()
    key[i]  = xxh3_128(prev + tokens[i] as little-endian uint32).digest()

so it changes chunk ``i``'s key and, through the chain, every later key; chunks without extras hash
exactly as before.

``digest()`` is xxhash's canonical (big-endian) 16-byte form. The chain makes a key depend on every
token before it, so equal keys mean equal prefixes; the seed makes it depend on the model geometry
(:meth:`lmcache.metadata.LMCacheMetadata.fingerprint`) and the cache salt (tenant isolation). Keys
do not depend on ``PYTHONHASHSEED``, the process or the host. The test vectors in
``tests/unit/test_keys.py`` pin the format; changing it needs a new format tag.

Token ids are packed once into one little-endian uint32 buffer, and each chunk's key hashes a
slice of that buffer (no per-token Python work besides the packing):

- a numpy array or a torch tensor is checked and packed at once, vectorized (dtype, shape and
  range in one pass; an ``int32`` or ``uint32`` array costs a copy at most);
- a list or tuple is packed by :class:`array.array` in growing runs of chunks as the chain
  reaches them, so a lookup that misses its first chunk reads one chunk, not the whole prompt.

:func:`chunk_keys` computes every key of a request at once (a store needs them all);
:class:`KeyChain` computes them on first use, in chain order.
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeAlias, overload

import numpy as np
import numpy.typing as npt
import torch
import xxhash

__all__ = [
    "EXTRA_MAX_NBYTES",
    "EXTRA_TAG",
    "KEY_FORMAT",
    "KEY_NBYTES",
    "KeyChain",
    "TokenIds",
    "chunk_keys",
    "chunk_ranges",
    "key_hex",
]

KEY_FORMAT = b"lmcache-chunk-key-v1\0"
"""Domain tag that starts the seed of every key chain."""

KEY_NBYTES = 16
"""Bytes per chunk key."""

EXTRA_TAG = b"lmcache-chunk-extra-v1\0"
"""Domain tag between the previous key and a chunk's extra key material."""

EXTRA_MAX_NBYTES = 64
"""Most bytes of extra key material per chunk (e.g. one or two 32-byte multimodal hashes)."""

TokenIds: TypeAlias = Sequence[int] | torch.Tensor | npt.NDArray[Any]
"""Token ids of one request: a sequence of ints (list, tuple), or a 1-D integer numpy array or
torch tensor ``[num_tokens]``."""

_UINT32_CODE = next(code for code in ("I", "L") if array(code).itemsize == 4)
_TOKEN_LIMIT = 2**32
_LE_UINT32 = np.dtype("<u4")


def chunk_ranges(num_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """Half-open token ranges ``[start, end)`` of the chunks of ``num_tokens`` tokens.

    Args:
        num_tokens: Number of tokens, >= 0.
        chunk_size: Tokens per chunk, > 0.

    Returns:
        ``[(0, c), (c, 2c), ...]``; the last range is partial when ``num_tokens % chunk_size``.

    Raises:
        ValueError: ``num_tokens < 0`` or ``chunk_size <= 0``.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, found {num_tokens}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, found {chunk_size}; use e.g. 256")
    full = num_tokens - num_tokens % chunk_size
    ranges = [(start, start + chunk_size) for start in range(0, full, chunk_size)]
    if full < num_tokens:
        ranges.append((full, num_tokens))
    return ranges


def chunk_keys(
    token_ids: TokenIds,
    fingerprint: bytes,
    chunk_size: int,
    *,
    salt: str | bytes = b"",
    extra_keys: Mapping[int, bytes] | None = None,
) -> list[bytes]:
    """One 16-byte key per chunk of ``token_ids`` (the trailing partial chunk included).

    Args:
        token_ids: Token ids in ``[0, 2**32)``: a list or tuple of ints, or an integer numpy
            array or torch tensor of shape ``[num_tokens]`` (a tensor on any device is copied
            to the CPU).
        fingerprint: Bytes of every fact that changes the KV bytes, usually
            ``LMCacheMetadata.fingerprint()``.
        chunk_size: Tokens per chunk, > 0.
        salt: Cache salt (str is UTF-8 encoded); different salts give disjoint keys.
        extra_keys: Extra key material per chunk index, e.g. ``{2: image_hash}`` when an image's
            placeholder tokens start in chunk 2. Folded into the chain before that chunk's
            tokens (tagged with :data:`EXTRA_TAG`), so it changes that key and every later one.
            Indices must be in ``[0, number of chunks)``; values 1 to
            :data:`EXTRA_MAX_NBYTES` bytes. ``None`` or ``{}``: no extras.

    Returns:
        ``len(chunk_ranges(len(token_ids), chunk_size))`` keys of :data:`KEY_NBYTES` bytes.

    Raises:
        ValueError: A token id is outside ``[0, 2**32)``, an array is not 1-D,
            ``chunk_size <= 0``, an ``extra_keys`` index is not a chunk index, or an extra
            value's length is outside ``[1, EXTRA_MAX_NBYTES]``.
        TypeError: ``fingerprint``/``salt`` have the wrong type, tokens are not integers (an
            array of a float, complex, bool or object dtype), or an ``extra_keys`` index is not
            an int or a value not bytes.
    """
    chain = KeyChain(token_ids, fingerprint, chunk_size, salt=salt, extra_keys=extra_keys)
    return chain[:]


class KeyChain(Sequence[bytes]):
    """The keys of :func:`chunk_keys`, each computed on first use (in chain order) and kept.

    ``chain[i]`` hashes chunks ``0..i`` if not done yet; ``len(chain)`` is the number of chunks
    and costs nothing. The arguments' types, an array's shape, dtype and values and
    ``extra_keys`` are checked at construction; the values of a list or tuple as their chunks
    are hashed (so a lookup that stops at its first missing chunk neither reads nor checks the
    tokens after it).

    Args: as :func:`chunk_keys`, and

        known: Keys of the leading chunks, already computed for exactly these tokens,
            fingerprint, salt and extra keys (e.g. by the lookup whose hit is now loaded): they
            are used as they are, and the chain goes on from the last of them. Not checked:
            keys of other tokens name other tokens' KV, so the caller must know they match.

    Raises:
        At construction: as :func:`chunk_keys`, except for the values of a list or tuple; when
        a chunk is hashed: ``ValueError`` / ``TypeError`` for a token id of that chunk outside
        ``[0, 2**32)`` or not an int.
    """

    __slots__ = (
        "_cs",
        "_extras",
        "_keys",
        "_n",
        "_num_chunks",
        "_prev",
        "_run",
        "_run_end",
        "_run_start",
        "_tokens",
    )

    def __init__(
        self,
        token_ids: TokenIds,
        fingerprint: bytes,
        chunk_size: int,
        *,
        salt: str | bytes = b"",
        extra_keys: Mapping[int, bytes] | None = None,
        known: Sequence[bytes] = (),
    ) -> None:
        if not isinstance(fingerprint, bytes | bytearray | memoryview):
            raise TypeError(
                f"fingerprint must be bytes (e.g. LMCacheMetadata.fingerprint()), found "
                f"{type(fingerprint).__name__}"
            )
        if isinstance(salt, str):
            salt_bytes = salt.encode("utf-8")
        elif isinstance(salt, bytes | bytearray):
            salt_bytes = bytes(salt)
        else:
            raise TypeError(f"salt must be str or bytes, found {type(salt).__name__}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, found {chunk_size}; use e.g. 256")
        packed = _packed_array(token_ids)
        self._tokens: Sequence[int] = token_ids if packed is None else ()  # type: ignore[assignment]
        self._n = len(token_ids) if packed is None else len(packed)
        self._cs = chunk_size
        self._num_chunks = -(-self._n // chunk_size)
        self._extras = _check_extras(extra_keys, self._num_chunks)
        self._keys: list[bytes] = [bytes(k) for k in known[: self._num_chunks]]
        if self._keys:
            self._prev = self._keys[-1]
        else:
            self._prev = xxhash.xxh3_128_digest(
                KEY_FORMAT + bytes(fingerprint) + b"\0" + salt_bytes
            )
        # the packed bytes of chunks [_run_start, _run_end); an array's hold every chunk
        self._run = memoryview(b"")
        self._run_start = self._run_end = 0
        if packed is not None:
            self._run = packed.data.cast("B")
            self._run_end = self._num_chunks

    def __len__(self) -> int:
        return self._num_chunks

    def computed(self) -> int:
        """How many leading keys are computed so far."""
        return len(self._keys)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._num_chunks)
            span = range(start, stop, step)
            if span:
                self._extend(max(span[0], span[-1]) + 1)
            if step == 1:
                return self._keys[start:stop]
            return [self._keys[i] for i in span]
        i = operator.index(index)
        if 0 <= i < len(self._keys):
            return self._keys[i]
        if i < 0:
            i += self._num_chunks
        if not 0 <= i < self._num_chunks:
            raise IndexError(f"chunk index {index} out of range for {self._num_chunks} chunks")
        self._extend(i + 1)
        return self._keys[i]

    def __iter__(self) -> Iterator[bytes]:
        for i in range(self._num_chunks):
            yield self[i]

    def _extend(self, count: int) -> None:
        """Compute keys up to ``count`` (exclusive)."""
        keys, extras, prev = self._keys, self._extras, self._prev
        step = self._cs * 4
        index = len(keys)
        while index < count:
            if index >= self._run_end:
                self._pack_run(index, count)
            run, base = self._run, self._run_start * step
            stop = min(count, self._run_end)
            for i in range(index, stop):
                if extras and i in extras:
                    prev = xxhash.xxh3_128_digest(prev + EXTRA_TAG + extras[i])
                start = i * step - base
                prev = xxhash.xxh3_128_digest(prev + run[start : start + step])
                keys.append(prev)
            index = stop
            self._prev = prev

    def _pack_run(self, first: int, count: int) -> None:
        """Pack the tokens of a list or tuple from chunk ``first`` on: at least through chunk
        ``count - 1``, and as many chunks as are packed already (runs double), so a chain read
        in small steps packs O(log n) times."""
        cs, tokens = self._cs, self._tokens
        end = min(self._num_chunks, max(count, 2 * first + 1))
        try:
            whole = first == 0 and end == self._num_chunks  # no slice: it would copy the list
            packed = _pack(tokens if whole else tokens[first * cs : end * cs], first * cs)
        except (TypeError, ValueError):
            if end == count:
                raise
            # a bad token beyond what is read now: pack only what is read (an error there is
            # the caller's; beyond it, the tokens are checked once their chunks are read)
            end = count
            packed = _pack(tokens[first * cs : end * cs], first * cs)
        self._run = memoryview(packed).cast("B")
        self._run_start, self._run_end = first, end


def key_hex(key: bytes) -> str:
    """Lower-case hex of a key, for logs and file names (32 characters)."""
    return bytes(key).hex()


def _check_extras(extra_keys: Mapping[int, bytes] | None, num_chunks: int) -> dict[int, bytes]:
    """Validated ``extra_keys`` as ``{chunk index: bytes}``."""
    if not extra_keys:
        return {}
    if not isinstance(extra_keys, Mapping):
        raise TypeError(
            f"extra_keys must be a mapping {{chunk index: bytes}}, found "
            f"{type(extra_keys).__name__}"
        )
    out: dict[int, bytes] = {}
    for index, value in extra_keys.items():
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(
                f"extra_keys index {index!r} is a {type(index).__name__}, expected an int chunk "
                "index (token position // chunk_size)"
            )
        if not 0 <= index < num_chunks:
            raise ValueError(
                f"extra_keys index {index} is not a chunk index: the tokens have {num_chunks} "
                f"chunk(s), indices 0..{num_chunks - 1}. Key extras by the chunk that holds their "
                "tokens (token position // chunk_size) and drop extras of tokens not passed."
            )
        if not isinstance(value, bytes | bytearray):
            raise TypeError(
                f"extra_keys[{index}] is a {type(value).__name__}, expected bytes (e.g. a "
                "multimodal item hash as bytes; hex strings: bytes.fromhex(h))"
            )
        if not 1 <= len(value) <= EXTRA_MAX_NBYTES:
            raise ValueError(
                f"extra_keys[{index}] has {len(value)} bytes, expected 1 to {EXTRA_MAX_NBYTES}. "
                f"Hash longer material first (e.g. xxh3_128 or sha256 of it)."
            )
        out[index] = bytes(value)
    return out


def _packed_array(token_ids: TokenIds) -> npt.NDArray[np.uint32] | None:
    """A numpy array's or torch tensor's token ids as a new contiguous little-endian uint32
    array, checked at once; ``None`` for any other sequence (packed as its chunks are read).

    Raises:
        ValueError: the array is not 1-D, or a token id is outside ``[0, 2**32)``.
        TypeError: the array's dtype is not an integer one.
    """
    if isinstance(token_ids, torch.Tensor):
        tensor = token_ids.detach()
        if tensor.dim() != 1:
            raise ValueError(
                f"token_ids tensor must be 1-D [num_tokens], found shape {tuple(tensor.shape)}; "
                "pass one request's token ids (e.g. ids[0] of a batch of one)"
            )
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise TypeError(
                f"token_ids tensor must have an integer dtype, found {tensor.dtype}; "
                "convert it with .long()"
            )
        values: npt.NDArray[Any] = tensor.cpu().numpy()
    elif isinstance(token_ids, np.ndarray):
        values = token_ids
        if values.ndim != 1:
            raise ValueError(
                f"token_ids array must be 1-D [num_tokens], found shape {values.shape}; "
                "pass one request's token ids (e.g. ids[0] of a batch of one)"
            )
        if values.dtype.kind not in "iu":
            raise TypeError(
                f"token_ids array must have an integer dtype, found {values.dtype}; "
                "convert it with .astype(np.int64)"
            )
    else:
        return None
    kind, size = values.dtype.kind, values.dtype.itemsize
    if values.size and not (kind == "u" and size <= 4):
        low = values.min()
        if low < 0 or (size > 4 and values.max() >= _TOKEN_LIMIT):
            bad = np.flatnonzero(
                (values < 0) | (values >= _TOKEN_LIMIT) if size > 4 else values < 0
            )
            raise _out_of_range(int(bad[0]), int(values[bad[0]]))
    packed = np.empty(len(values), dtype=_LE_UINT32)
    packed[:] = values  # one vectorized conversion, into memory no caller can change
    return packed


def _pack(values: Sequence[int], offset: int) -> array[int]:
    """``values`` (token ids from index ``offset`` on) as a little-endian uint32 array."""
    try:
        packed = array(_UINT32_CODE, values)
    except (OverflowError, TypeError) as exc:
        raise _bad_token(values, offset) from exc
    if sys.byteorder == "big":
        packed.byteswap()
    return packed


def _out_of_range(index: int, token: int) -> ValueError:
    return ValueError(
        f"token_ids[{index}] = {token} is outside [0, 2**32): chunk keys pack token ids "
        "as uint32; check the tokenizer output"
    )


def _bad_token(values: Sequence[int], offset: int = 0) -> Exception:
    for index, token in enumerate(values, offset):
        if not isinstance(token, int):
            try:
                token = token.__index__()
            except (AttributeError, TypeError):
                return TypeError(
                    f"token_ids[{index}] = {token!r} is a {type(token).__name__}, expected an int"
                )
        if not 0 <= token < _TOKEN_LIMIT:
            return _out_of_range(index, token)
    return TypeError(
        "token_ids must be a list or tuple of ints, or a 1-D integer numpy array or torch tensor"
    )
