# SPDX-License-Identifier: Apache-2.0
"""Scheduler -> worker cache lookups over Unix-domain sockets.

vLLM asks the *scheduler-side* connector how many prompt tokens the external cache holds, but
the cache lives with the *workers* (one shard per tensor-parallel rank, possibly in other
processes). Each worker rank runs a :class:`LookupServer` in a daemon thread; the scheduler's
:class:`LookupClient` asks every rank and takes the minimum (a token counts only when every
rank holds its shard).

Where: ``<tempfile.gettempdir()>/lmcache-vllm-<uid>-<engine digest>/rank<r>.sock``; the folder
is created ``0700`` and the socket ``0600``, so only this user can connect. The engine digest
is a short hash of ``kv_transfer_config.engine_id`` (socket paths are limited to ~100 bytes).

Wire format (little-endian, ``struct``; no pickle):

- lookup request: ``u32 salt_len, salt (utf-8), u32 n, n x u32 token ids``;
  reply: ``i64`` leading tokens present (``-1``: the server failed).
- clear request: ``u32 0xFFFFFFFF``; reply: ``i64`` 0 (``-1``: the server failed).

A rank that cannot be reached, answers garbage or is slower than the (short) timeout counts as
0 hit tokens: a lookup failure is a cache miss, never a failed request.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "CLEAR_MARKER",
    "LookupClient",
    "LookupServer",
    "MAX_SALT_BYTES",
    "MAX_TOKENS",
    "decode_request",
    "encode_clear",
    "encode_lookup",
    "socket_dir",
    "socket_path",
]

logger = logging.getLogger(__name__)

CLEAR_MARKER = 0xFFFFFFFF
"""``salt_len`` value that marks a clear request."""
MAX_SALT_BYTES = 1 << 12
"""Largest accepted salt (bytes); longer requests are rejected."""
MAX_TOKENS = 1 << 22
"""Largest accepted token count per lookup; longer requests are rejected."""

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


def socket_dir(engine_id: str, *, base: str | os.PathLike[str] | None = None) -> Path:
    """The per-engine folder holding the rank sockets (not created here)."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    root = Path(base) if base is not None else Path(tempfile.gettempdir())
    return root / f"lmcache-vllm-{os.getuid()}-{digest}"


def socket_path(engine_id: str, rank: int, *, base: str | os.PathLike[str] | None = None) -> Path:
    """Socket of ``rank``'s lookup server for ``engine_id``."""
    return socket_dir(engine_id, base=base) / f"rank{rank}.sock"


def encode_lookup(tokens: Sequence[int], salt: str = "") -> bytes:
    """Frame a lookup request (see the module docstring)."""
    salt_b = salt.encode("utf-8")
    if len(salt_b) > MAX_SALT_BYTES:
        raise ValueError(f"cache salt is {len(salt_b)} bytes; at most {MAX_SALT_BYTES} allowed")
    if len(tokens) > MAX_TOKENS:
        raise ValueError(f"{len(tokens)} tokens in one lookup; at most {MAX_TOKENS} allowed")
    return b"".join(
        (
            _U32.pack(len(salt_b)),
            salt_b,
            _U32.pack(len(tokens)),
            struct.pack(f"<{len(tokens)}I", *tokens),
        )
    )


def encode_clear() -> bytes:
    """Frame a clear request."""
    return _U32.pack(CLEAR_MARKER)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


def decode_request(sock: socket.socket) -> tuple[str, list[int]] | None:
    """Read one request from ``sock``.

    Returns:
        ``(salt, tokens)`` for a lookup, ``None`` for a clear.

    Raises:
        ConnectionError: the peer closed mid-request.
        ValueError: a length beyond the limits or a salt that is not utf-8.
    """
    (salt_len,) = _U32.unpack(_recv_exact(sock, 4))
    if salt_len == CLEAR_MARKER:
        return None
    if salt_len > MAX_SALT_BYTES:
        raise ValueError(f"salt length {salt_len} exceeds {MAX_SALT_BYTES}")
    salt = _recv_exact(sock, salt_len).decode("utf-8") if salt_len else ""
    (n,) = _U32.unpack(_recv_exact(sock, 4))
    if n > MAX_TOKENS:
        raise ValueError(f"token count {n} exceeds {MAX_TOKENS}")
    tokens = list(struct.unpack(f"<{n}I", _recv_exact(sock, 4 * n))) if n else []
    return salt, tokens


class LookupServer:
    """Answers lookups for one worker rank from a daemon thread.

    Args:
        engine_id: ``kv_transfer_config.engine_id`` (names the socket folder).
        rank: This worker's tensor-parallel rank.
        lookup: ``(tokens, salt) -> leading tokens present``.
        clear: Empties this rank's cache.
        base: Folder to put the socket folder in (default ``tempfile.gettempdir()``).
    """

    def __init__(
        self,
        engine_id: str,
        rank: int,
        lookup: Callable[[list[int], str], int],
        clear: Callable[[], None],
        *,
        base: str | os.PathLike[str] | None = None,
    ) -> None:
        self.path = socket_path(engine_id, rank, base=base)
        self._lookup = lookup
        self._clear = clear
        self._closed = threading.Event()
        folder = self.path.parent
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(
                f"lookup socket folder {folder} is not a directory owned by uid {os.getuid()}; "
                "remove it or set TMPDIR to a private folder"
            )
        os.chmod(folder, 0o700)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self._sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._sock.listen(16)
        self._thread = threading.Thread(
            target=self._serve, name=f"lmcache-lookup-rank{rank}", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    request = decode_request(conn)
                except (ConnectionError, OSError):
                    return
                except ValueError as exc:
                    logger.warning("lmcache lookup server: bad request (%s); closing", exc)
                    return
                try:
                    if request is None:
                        self._clear()
                        answer = 0
                    else:
                        answer = int(self._lookup(request[1], request[0]))
                except Exception:
                    logger.exception("lmcache lookup server: lookup failed; answering -1")
                    answer = -1
                try:
                    conn.sendall(_I64.pack(answer))
                except OSError:
                    return

    def close(self) -> None:
        """Stop serving and remove the socket file (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # only when no other rank's socket remains


class LookupClient:
    """Asks every rank's :class:`LookupServer` and combines the answers.

    Args:
        engine_id: ``kv_transfer_config.engine_id``.
        world_size: Number of ranks (tensor-parallel size) to ask.
        timeout_s: Per-rank socket timeout of one request.
        first_wait_s: At first use, how long to wait for the sockets to appear.
        base: As for :class:`LookupServer`.
    """

    def __init__(
        self,
        engine_id: str,
        world_size: int,
        *,
        timeout_s: float = 2.0,
        first_wait_s: float = 10.0,
        base: str | os.PathLike[str] | None = None,
    ) -> None:
        self.paths = [socket_path(engine_id, r, base=base) for r in range(world_size)]
        self.timeout_s = timeout_s
        self._first_wait_s = first_wait_s
        self._conns: list[socket.socket | None] = [None] * world_size
        self._lock = threading.Lock()

    def _conn(self, rank: int) -> socket.socket:
        conn = self._conns[rank]
        if conn is not None:
            return conn
        path = self.paths[rank]
        deadline = time.monotonic() + self._first_wait_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
            except OSError:
                sock.close()
                raise
        self._first_wait_s = 0.0  # waited once; later failures are immediate misses
        self._conns[rank] = sock
        return sock

    def _ask(self, rank: int, payload: bytes) -> int:
        try:
            conn = self._conn(rank)
            conn.sendall(payload)
            (answer,) = _I64.unpack(_recv_exact(conn, 8))
            return int(answer)
        except (OSError, ConnectionError, struct.error) as exc:
            logger.warning(
                "lmcache lookup: rank %d at %s unreachable (%s); counting a miss",
                rank,
                self.paths[rank],
                exc,
            )
            self._drop(rank)
            return -1

    def _drop(self, rank: int) -> None:
        conn = self._conns[rank]
        self._conns[rank] = None
        if conn is not None:
            conn.close()

    def lookup(self, tokens: Sequence[int], salt: str = "") -> int:
        """Leading tokens every rank holds; 0 when any rank fails or does not answer."""
        payload = encode_lookup(tokens, salt)
        with self._lock:
            hits = [self._ask(rank, payload) for rank in range(len(self.paths))]
        if not hits or min(hits) < 0:
            return 0
        return min(hits)

    def clear(self) -> bool:
        """Ask every rank to empty its cache; True when all answered."""
        with self._lock:
            answers = [self._ask(rank, encode_clear()) for rank in range(len(self.paths))]
        return all(a >= 0 for a in answers)

    def close(self) -> None:
        """Close the connections (idempotent)."""
        with self._lock:
            for rank in range(len(self._conns)):
                self._drop(rank)
