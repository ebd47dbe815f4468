# SPDX-License-Identifier: Apache-2.0
"""The node cache's wire format: msgpack frames of msgspec structs over a Unix socket.

A frame is a 4-byte little-endian length followed by that many bytes of msgpack. One frame holds
one message. A request whose class is in :data:`CALLS` gets exactly one reply frame; the others
(:class:`Commit`, :class:`Release`, :class:`Touch`, :class:`Drop`, :class:`Bye`) get none, and a connection's
frames are handled in the order they were sent. Every field is bounded (key lengths, list
lengths, integer ranges, dtype names) and checked when a frame is decoded, so a malformed or
oversized frame is an error for that connection only. Nothing is ever unpickled.
"""

from __future__ import annotations

import socket
import struct
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

__all__ = [
    "CALLS",
    "MAX_FRAME_BYTES",
    "MAX_KEYS",
    "PROTOCOL_VERSION",
    "Alloc",
    "Bye",
    "AllocReply",
    "BoolReply",
    "Clear",
    "Commit",
    "CountReply",
    "Drop",
    "ErrorReply",
    "FrameError",
    "FrameReader",
    "GetMany",
    "GetManyReply",
    "GetReply",
    "Hello",
    "IsOrphan",
    "Missing",
    "MissingReply",
    "Release",
    "Remove",
    "Reply",
    "Request",
    "Stats",
    "StatsReply",
    "Touch",
    "Welcome",
    "decode_reply",
    "decode_request",
    "encode",
    "read_frame",
]

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change; the owner refuses a client of another version."""

MAX_FRAME_BYTES = 1 << 20
"""The largest frame either side accepts (a 1 MiB frame holds ~50k keys; lists are capped
lower)."""

MAX_KEYS = 16384
"""The most keys, blocks or holds one message carries (4M tokens of 256-token chunks)."""

Key = Annotated[bytes, Meta(min_length=1, max_length=64)]
Owner = Annotated[bytes, Meta(max_length=8192)]
Session = Annotated[bytes, Meta(min_length=16, max_length=16)]
BlockId = Annotated[int, Meta(ge=1, le=2**62)]
Bytes64 = Annotated[int, Meta(ge=0, le=2**48)]
Count = Annotated[int, Meta(ge=0, le=MAX_KEYS)]
Dim = Annotated[int, Meta(ge=0, le=2**40)]
Shape = Annotated[list[Dim], Meta(max_length=8)]
DType = Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
Sum = int  # msgpack integers are int64 or uint64: bounded by the format
Pid = Annotated[int, Meta(ge=0, le=2**31)]
Keys = Annotated[list[Key], Meta(max_length=MAX_KEYS)]
Text = Annotated[str, Meta(max_length=4096)]


class _Msg(Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    pass


# ------------------------------------------------------------------------------ requests


class Hello(_Msg, tag=1):
    """First frame of a connection: who the client is and which blocks it still holds.

    ``holds`` lists ``(block, count)`` of the leases the client holds from this owner's arena
    (after a reconnect); the owner sets the session's counts to them.
    """

    version: int
    session: Session
    pid: Pid
    generation: Annotated[str, Meta(max_length=64)]
    holds: Annotated[list[tuple[BlockId, Count]], Meta(max_length=MAX_KEYS)]


class Missing(_Msg, tag=2):
    """Positions of the ``keys`` not stored (ready)."""

    keys: Keys


class Alloc(_Msg, tag=4):
    """Up to ``count`` blocks of ``nbytes`` for this session, evicting unleased entries (never
    those in ``protect``)."""

    nbytes: Bytes64
    count: Annotated[int, Meta(ge=1, le=MAX_KEYS)]
    protect: Keys


class Commit(_Msg, tag=5):
    """Publish a block this session wrote as the chunk ``key`` (one-way)."""

    block: BlockId
    key: Key
    parent: Key | None
    owner: Owner
    checksum: Sum | None
    device_sum: Sum | None
    shape: Shape
    dtype: DType


class Release(_Msg, tag=6):
    """Drop one of this session's leases on each block (one-way)."""

    blocks: Annotated[list[BlockId], Meta(max_length=MAX_KEYS)]


class Touch(_Msg, tag=7):
    """Mark a run of one key chain used, ``keys[0]`` the most recent (one-way)."""

    keys: Keys


class Drop(_Msg, tag=8):
    """Drop the entry ``key`` if it is still in ``block`` (its bytes failed a check; one-way)."""

    key: Key
    block: BlockId


class Remove(_Msg, tag=9):
    """Drop the entry ``key``; replies whether there was one."""

    key: Key


class Clear(_Msg, tag=10):
    """Drop every entry (``owner`` None) or those committed with ``owner``; replies a count."""

    owner: Owner | None


class IsOrphan(_Msg, tag=11):
    """Whether ``key`` is stored and the parent it was stored with is not."""

    key: Key


class Stats(_Msg, tag=12):
    """The owner's counters."""


class Bye(_Msg, tag=14):
    """The session ends now: the client holds no lease (one-way; the owner closes)."""


class GetMany(_Msg, tag=13):
    """Lease the longest run of leading ``keys`` that are ready (one request for a hit)."""

    keys: Keys


Request = (
    Hello
    | Missing
    | GetMany
    | Alloc
    | Commit
    | Release
    | Touch
    | Drop
    | Remove
    | Clear
    | IsOrphan
    | Stats
    | Bye
)

CALLS: tuple[type[_Msg], ...] = (
    Hello,
    Missing,
    GetMany,
    Alloc,
    Remove,
    Clear,
    IsOrphan,
    Stats,
)
"""Requests that get one reply frame."""

# ------------------------------------------------------------------------------ replies


class Welcome(_Msg, tag=101):
    """The owner's answer to :class:`Hello`: the arena to map and whether the session's leases
    survived (``resumed``)."""

    generation: Annotated[str, Meta(max_length=64)]
    arena_path: Text
    arena_bytes: Bytes64
    data_offset: Bytes64
    budget_bytes: Bytes64
    owner_pid: Pid
    resumed: bool


class MissingReply(_Msg, tag=102):
    positions: Annotated[list[Count], Meta(max_length=MAX_KEYS)]


class GetReply(_Msg, tag=103):
    """A lease on a ready chunk (an element of :class:`GetManyReply`)."""

    block: BlockId
    offset: Bytes64
    nbytes: Bytes64
    shape: Shape
    dtype: DType
    checksum: Sum | None
    device_sum: Sum | None


class GetManyReply(_Msg, tag=108):
    """One :class:`GetReply` per leading key found (each leased)."""

    chunks: Annotated[list[GetReply], Meta(max_length=MAX_KEYS)]


class AllocReply(_Msg, tag=104):
    """``(block, offset)`` of each block leased, and how many entries were evicted for them."""

    blocks: Annotated[list[tuple[BlockId, Bytes64]], Meta(max_length=MAX_KEYS)]
    evicted: Count


class BoolReply(_Msg, tag=105):
    value: bool


class CountReply(_Msg, tag=106):
    value: Bytes64


class StatsReply(_Msg, tag=107):
    entries: Bytes64
    used_bytes: Bytes64
    budget_bytes: Bytes64
    sessions: Bytes64
    attached: Bytes64
    leased_blocks: Bytes64
    evicted: Bytes64
    generation: Annotated[str, Meta(max_length=64)]


class ErrorReply(_Msg, tag=199):
    message: Text


Reply = (
    Welcome
    | MissingReply
    | GetReply
    | GetManyReply
    | AllocReply
    | BoolReply
    | CountReply
    | StatsReply
    | ErrorReply
)

_HEADER = struct.Struct("<I")
_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


class FrameError(Exception):
    """A frame that cannot be accepted: too large, truncated, or not a valid message."""


def encode(msg: _Msg) -> bytes:
    """One frame: the length prefix and the msgpack of ``msg``."""
    body = _encoder.encode(msg)
    return _HEADER.pack(len(body)) + body


def decode_request(body: bytes | memoryview) -> Request:
    """The request in a frame body.

    Raises:
        FrameError: not a valid request (unknown tag, a field out of bounds, bad msgpack).
    """
    try:
        return _requests.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"invalid request frame: {exc}") from None


def decode_reply(body: bytes | memoryview) -> Reply:
    """The reply in a frame body.

    Raises:
        FrameError: not a valid reply.
    """
    try:
        return _replies.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"invalid reply frame: {exc}") from None


class FrameReader:
    """Splits a byte stream into frame bodies (for a non-blocking reader)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Append ``data``; returns the bodies of the frames now complete.

        Raises:
            FrameError: a frame announces more than :data:`MAX_FRAME_BYTES`.
        """
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= 4:
            (size,) = _HEADER.unpack_from(self._buf)
            if size > MAX_FRAME_BYTES:
                raise FrameError(f"frame of {size} bytes, above the {MAX_FRAME_BYTES} limit")
            if len(self._buf) < 4 + size:
                break
            out.append(bytes(self._buf[4 : 4 + size]))
            del self._buf[: 4 + size]
        return out


def read_frame(sock: socket.socket) -> bytes:
    """The body of the next frame on a blocking socket (its timeout applies to each read).

    Raises:
        FrameError: the peer closed the connection or sent an oversized frame.
        OSError: the socket failed or timed out.
    """
    data = sock.recv(1 << 16)  # a reply usually arrives whole: one read
    if len(data) < 4:
        data += _read_exact(sock, 4 - len(data)) if data else _read_exact(sock, 4)
    (size,) = _HEADER.unpack_from(data)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes, above the {MAX_FRAME_BYTES} limit")
    if len(data) > 4 + size:
        raise FrameError("the peer sent more than one reply")
    return data[4:] + _read_exact(sock, 4 + size - len(data))


def _read_exact(sock: socket.socket, n: int) -> bytes:
    if n == 0:
        return b""
    first = sock.recv(n)
    if len(first) == n:
        return first
    buf = bytearray(first)
    while len(buf) < n:
        if not first:
            raise FrameError("the node cache owner closed the connection")
        first = sock.recv(n - len(buf))
        buf += first
    return bytes(buf)
