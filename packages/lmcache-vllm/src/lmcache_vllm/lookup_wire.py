# SPDX-License-Identifier: Apache-2.0
"""Wire format of the scheduler -> worker lookups of :mod:`lmcache_vllm.lookup_sockets`.

Little-endian :mod:`struct` framing, no pickle: a peer can send only numbers, bounded text and
bounded bytes, and every length is checked against its limit before its bytes are read. A request
starts with ``u8 op``:

- ``op = 1`` (:data:`OP_LOOKUP`) lookup::

      u16 id_len,   id_len bytes    request id (utf-8, <= MAX_ID_BYTES)
      u16 salt_len, salt_len bytes  cache salt (utf-8, <= MAX_SALT_BYTES)
      u16 n_extra,                  extra key material (<= MAX_EXTRA_KEYS entries)
          n_extra x (u32 chunk index, u8 len, len bytes)   1 <= len <= MAX_EXTRA_KEY_BYTES
      u32 n_tokens, n_tokens x u32  prompt token ids (<= MAX_TOKENS)

- ``op = 2`` (:data:`OP_CLEAR`) clear: no body.
- ``op = 3`` (:data:`OP_AGAIN`) the same lookup again (vLLM asks again for a waiting request)::

      u16 id_len,   id_len bytes    request id (utf-8, <= MAX_ID_BYTES)
      16 bytes                      xxh3-128 of the lookup's whole frame (:func:`lookup_digest`)

  The server answers it as the lookup it remembers under that request id and digest (it keeps
  the latest ones it received, bounded), or with :data:`UNKNOWN` when it has none: the client
  then sends the whole lookup. Only a few dozen bytes cross the socket instead of 4 per token.

The reply to any request is one ``i64`` (:data:`REPLY`): the leading tokens present (0 for a
clear), ``-1`` when the server failed (the callback raised or returned a value outside
``[0, n_tokens]``), or :data:`UNKNOWN` (``-2``, to ``op = 3`` only). A request that breaks the
format or a limit makes the server close that connection, with one warning.

:func:`encode_lookup`, :func:`encode_again` and :func:`encode_clear` frame requests (the first
refuses a query beyond a limit with :class:`ValueError`); :func:`decode_request` and
:func:`decode_request_body` read them back from a blocking socket. Sockets, connections,
deadlines and failures are :mod:`lmcache_vllm.lookup_sockets`' part.
"""

from __future__ import annotations

import operator
import socket
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = [
    "DIGEST_BYTES",
    "MAX_EXTRA_KEYS",
    "MAX_EXTRA_KEY_BYTES",
    "MAX_ID_BYTES",
    "MAX_SALT_BYTES",
    "MAX_TOKENS",
    "OP_AGAIN",
    "OP_CLEAR",
    "OP_LOOKUP",
    "REPLY",
    "UNKNOWN",
    "Again",
    "LookupQuery",
    "check_lookup",
    "decode_request",
    "decode_request_body",
    "encode_again",
    "encode_clear",
    "encode_lookup",
    "lookup_digest",
]

OP_LOOKUP = 1
"""Request op byte of a lookup."""
OP_CLEAR = 2
"""Request op byte of a clear."""
OP_AGAIN = 3
"""Request op byte of a lookup sent before, named by its request id and frame digest."""
MAX_ID_BYTES = 256
"""Largest request id (utf-8 bytes)."""
MAX_SALT_BYTES = 256
"""Largest cache salt (utf-8 bytes); the adapter hashes longer salts before building a query."""
MAX_EXTRA_KEYS = 4096
"""Most extra-key entries (chunk index -> bytes) in one lookup."""
MAX_EXTRA_KEY_BYTES = 64
"""Largest extra-key value (bytes); values are at least 1 byte."""
MAX_TOKENS = 1 << 22
"""Most token ids in one lookup."""

REPLY = struct.Struct("<q")
"""The reply to any request: one little-endian ``i64`` (hit tokens; 0 for a clear; -1: failed;
:data:`UNKNOWN`)."""
UNKNOWN = -2
"""The reply to an :data:`OP_AGAIN` whose lookup the server does not remember: send it whole."""
DIGEST_BYTES = 16
"""Bytes of a lookup frame's digest (xxh3-128)."""

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_EXTRA_HEAD = struct.Struct("<IB")
_TOKEN_LIMIT = 1 << 32


@dataclass(frozen=True, eq=False)
class LookupQuery:
    """One scheduler -> worker lookup.

    Attributes:
        req_id: vLLM request id; the worker leases the hit chunks under it. Any string; more than
            :data:`MAX_ID_BYTES` utf-8 bytes is an error at encode.
        tokens: Prompt token ids, each in ``[0, 2**32)``; at most :data:`MAX_TOKENS`. A
            decoded query holds them as a read-only little-endian uint32 numpy array (read
            from the frame with no per-token work; chunk keys hash it as it is).
        salt: Already-derived key salt (the adapter hashes long cache salts); at most
            :data:`MAX_SALT_BYTES` utf-8 bytes.
        extra_keys: Chunk index -> extra key material of that chunk (1 to
            :data:`MAX_EXTRA_KEY_BYTES` bytes); at most :data:`MAX_EXTRA_KEYS` entries.
    """

    req_id: str
    tokens: Sequence[int] | npt.NDArray[Any]
    salt: str = ""
    extra_keys: Mapping[int, bytes] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        """Equal fields, token ids compared by value (a list equals its decoded array)."""
        if not isinstance(other, LookupQuery):
            return NotImplemented
        return (
            (self.req_id, self.salt, dict(self.extra_keys))
            == (other.req_id, other.salt, dict(other.extra_keys))
            and len(self.tokens) == len(other.tokens)
            and all(int(a) == int(b) for a, b in zip(self.tokens, other.tokens, strict=True))
        )


@dataclass(frozen=True)
class Again:
    """A lookup sent before (:data:`OP_AGAIN`), as decoded by the server.

    Attributes:
        req_id: The request id of that lookup.
        digest: :func:`lookup_digest` of that lookup (its whole frame's xxh3-128).
    """

    req_id: str
    digest: bytes


def _utf8(text: str, limit: int, what: str) -> bytes:
    """``text`` as utf-8, at most ``limit`` bytes; ``what`` names it in the ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"lookup {what}: expected a str, found {type(text).__name__}")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"lookup {what} is not encodable as utf-8 ({exc.reason} at {exc.start})"
        ) from None
    if len(data) > limit:
        raise ValueError(
            f"lookup {what} is {len(data)} utf-8 bytes; expected at most {limit} "
            f"(hash longer values before building the LookupQuery)"
        )
    return data


def _bad_token(tokens: Sequence[int] | npt.NDArray[Any]) -> str:
    """Which token failed to pack as a u32, and why (for the ValueError)."""
    for i, token in enumerate(tokens):
        try:
            value = operator.index(token)
        except TypeError:
            return f"token {i} is a {type(token).__name__}, expected an int"
        if not 0 <= value < _TOKEN_LIMIT:
            return f"token {i} is {value}, expected a value in [0, 2**32)"
    return "a token is not a u32"


def _head(query: LookupQuery) -> list[bytes]:
    """Every part of a lookup's frame before its tokens, each limit checked (see
    :func:`encode_lookup`); the token count too, not the tokens."""
    req_id = _utf8(query.req_id, MAX_ID_BYTES, "request id")
    salt = _utf8(query.salt, MAX_SALT_BYTES, "salt")
    n = len(query.tokens)
    if n > MAX_TOKENS:
        raise ValueError(
            f"lookup has {n} tokens; expected at most {MAX_TOKENS} (MAX_TOKENS); "
            "longer prompts cannot be looked up"
        )
    extra = query.extra_keys
    if len(extra) > MAX_EXTRA_KEYS:
        raise ValueError(
            f"lookup has {len(extra)} extra keys; expected at most {MAX_EXTRA_KEYS} (MAX_EXTRA_KEYS)"
        )
    parts = [_U8.pack(OP_LOOKUP), _U16.pack(len(req_id)), req_id, _U16.pack(len(salt)), salt]
    parts.append(_U16.pack(len(extra)))
    for index, value in extra.items():
        if not isinstance(value, bytes | bytearray | memoryview):
            raise ValueError(
                f"extra key of chunk {index!r} is a {type(value).__name__}; expected bytes"
            )
        data = bytes(value)
        if not 1 <= len(data) <= MAX_EXTRA_KEY_BYTES:
            raise ValueError(
                f"extra key of chunk {index!r} is {len(data)} bytes; expected 1 to "
                f"{MAX_EXTRA_KEY_BYTES} (hash longer material first)"
            )
        try:
            parts.append(_EXTRA_HEAD.pack(index, len(data)))
        except struct.error:
            raise ValueError(
                f"extra key chunk index {index!r}: expected an int in [0, 2**32)"
            ) from None
        parts.append(data)
    parts.append(_U32.pack(n))
    return parts


def check_lookup(query: LookupQuery) -> None:
    """The limits :func:`encode_lookup` checks, without packing the tokens: for a lookup
    answered in this process (the tokens themselves are checked where their keys are made).

    Raises:
        ValueError: As :func:`encode_lookup`, except for token values.
    """
    _head(query)


def encode_lookup(query: LookupQuery) -> bytes:
    """Frame a lookup request (format in the module docstring).

    Raises:
        ValueError: A field beyond its limit, a token id outside ``[0, 2**32)``, an extra key
            that is not 1 to :data:`MAX_EXTRA_KEY_BYTES` bytes or whose chunk index is not a u32.
    """
    parts = _head(query)
    tokens = query.tokens
    try:
        if isinstance(tokens, np.ndarray):
            if tokens.dtype.kind not in "iu" or (
                tokens.size and (tokens.min() < 0 or tokens.max() >= _TOKEN_LIMIT)
            ):
                raise OverflowError
            packed = tokens.astype("<u4").tobytes()
        else:
            words = array("I", tokens)  # one C loop over the list (no per-token Python)
            if words.itemsize != 4:
                raise OverflowError  # pragma: no cover - no such platform in use
            if sys.byteorder == "big":  # pragma: no cover
                words.byteswap()
            packed = words.tobytes()
    except (OverflowError, TypeError):
        raise ValueError(f"lookup tokens: {_bad_token(tokens)}") from None
    parts.append(packed)
    return b"".join(parts)


def lookup_digest(query: LookupQuery, frame: bytes | None = None) -> bytes:
    """xxh3-128 of the frame :func:`encode_lookup` makes of ``query`` (``frame``, when given,
    is that frame: it is hashed as it is).

    A decoded query (little-endian uint32 token ids) is hashed without building its frame.

    Raises:
        ValueError: As :func:`encode_lookup`.
    """
    if frame is not None:
        return xxhash.xxh3_128_digest(frame)
    tokens = query.tokens
    if not (isinstance(tokens, np.ndarray) and tokens.dtype == np.dtype("<u4")):
        return xxhash.xxh3_128_digest(encode_lookup(query))
    hasher = xxhash.xxh3_128()
    for part in _head(query):
        hasher.update(part)
    hasher.update(np.ascontiguousarray(tokens).data.cast("B"))
    return hasher.digest()


def encode_again(req_id: str, digest: bytes) -> bytes:
    """Frame an :data:`OP_AGAIN` request: the lookup of ``req_id`` whose frame hashed to
    ``digest`` (:func:`lookup_digest`), sent before.

    Raises:
        ValueError: ``req_id`` beyond :data:`MAX_ID_BYTES`, or a digest of another length.
    """
    data = _utf8(req_id, MAX_ID_BYTES, "request id")
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"lookup digest is {len(digest)} bytes; expected {DIGEST_BYTES}")
    return b"".join((_U8.pack(OP_AGAIN), _U16.pack(len(data)), data, bytes(digest)))


def encode_clear() -> bytes:
    """Frame a clear request."""
    return _U8.pack(OP_CLEAR)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes from ``sock``; ConnectionError if the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return buf


def _recv_str(sock: socket.socket, limit: int, what: str) -> str:
    """A ``u16``-length-prefixed utf-8 string of at most ``limit`` bytes (else ValueError)."""
    (size,) = _U16.unpack(_recv_exact(sock, 2))
    if size > limit:
        raise ValueError(f"{what} length {size} exceeds the limit {limit}")
    try:
        return _recv_exact(sock, size).decode("utf-8") if size else ""
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not utf-8 ({exc.reason} at byte {exc.start})") from None


def decode_request_body(sock: socket.socket, op: int) -> LookupQuery | Again | None:
    """Read the rest of a request whose op byte, ``op``, was already read from ``sock``.

    Returns:
        The :class:`LookupQuery` of a lookup, an :class:`Again` for a lookup sent before,
        ``None`` for a clear.

    Raises:
        ConnectionError: The peer closed before the request was complete.
        ValueError: As for :func:`decode_request`.
    """
    if op == OP_CLEAR:
        return None
    if op == OP_AGAIN:
        again_id = _recv_str(sock, MAX_ID_BYTES, "request id")
        return Again(again_id, bytes(_recv_exact(sock, DIGEST_BYTES)))
    if op != OP_LOOKUP:
        raise ValueError(
            f"unknown op {op}; expected {OP_LOOKUP} (lookup), {OP_CLEAR} (clear) or "
            f"{OP_AGAIN} (lookup again)"
        )
    req_id = _recv_str(sock, MAX_ID_BYTES, "request id")
    salt = _recv_str(sock, MAX_SALT_BYTES, "salt")
    (n_extra,) = _U16.unpack(_recv_exact(sock, 2))
    if n_extra > MAX_EXTRA_KEYS:
        raise ValueError(f"{n_extra} extra keys exceed the limit {MAX_EXTRA_KEYS}")
    extra: dict[int, bytes] = {}
    for _ in range(n_extra):
        index, size = _EXTRA_HEAD.unpack(_recv_exact(sock, _EXTRA_HEAD.size))
        if not 1 <= size <= MAX_EXTRA_KEY_BYTES:
            raise ValueError(
                f"extra key of chunk {index} is {size} bytes; expected 1 to {MAX_EXTRA_KEY_BYTES}"
            )
        if index in extra:
            raise ValueError(f"chunk index {index} appears twice among the extra keys")
        extra[index] = bytes(_recv_exact(sock, size))
    (n,) = _U32.unpack(_recv_exact(sock, 4))
    if n > MAX_TOKENS:
        raise ValueError(f"token count {n} exceeds the limit {MAX_TOKENS}")
    tokens = np.frombuffer(_recv_exact(sock, 4 * n), dtype="<u4") if n else _NO_TOKENS
    tokens.flags.writeable = False  # a snapshot: the load compares its keys' tokens with it
    return LookupQuery(req_id=req_id, tokens=tokens, salt=salt, extra_keys=extra)


_NO_TOKENS: npt.NDArray[np.uint32] = np.empty(0, dtype="<u4")


def decode_request(sock: socket.socket) -> LookupQuery | Again | None:
    """Read one request from ``sock`` (blocking, under the socket's own timeout).

    Returns:
        As :func:`decode_request_body`.

    Raises:
        ConnectionError: The peer closed before the request was complete.
        ValueError: An unknown op, a length beyond its limit, text that is not utf-8 or a chunk
            index repeated among the extra keys.
    """
    return decode_request_body(sock, _recv_exact(sock, 1)[0])
