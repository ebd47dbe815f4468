# SPDX-License-Identifier: Apache-2.0
"""The worker side of a scheduler -> worker lookup: one :class:`LookupServer` per rank.

Each worker rank starts one once its KV caches are registered.
It answers from daemon threads, one per connection, so one slow or stuck peer never blocks another.
A client in the same process calls it directly (:func:`local_server`).
The server remembers the latest lookups it received (:class:`_Remembered`), so a client that
asks again for a waiting request names it (:data:`~lmcache_vllm.lookup_wire.OP_AGAIN`) instead
of sending its token ids again.
:mod:`lmcache_vllm.lookup_sockets` walks through the whole exchange.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import socket
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from lmcache_vllm.lookup_sockets import SUN_PATH_MAX, LogThrottle, socket_path
from lmcache_vllm.lookup_wire import (
    REPLY,
    UNKNOWN,
    Again,
    LookupQuery,
    decode_request_body,
    lookup_digest,
)

__all__ = ["LookupServer", "local_server"]

logger = logging.getLogger(__name__)

_BODY_TIMEOUT_S = 10.0
"""Server side: once a request's first byte arrived, the rest must follow within this time."""


REMEMBERED_LOOKUPS = 256
"""Most lookups a server remembers for :data:`~lmcache_vllm.lookup_wire.OP_AGAIN` (the newest)."""
REMEMBERED_TOKENS = 1 << 24
"""Most token ids those lookups hold together (4 bytes each: 64 MiB)."""


class _Remembered:
    """The latest lookups received, by request id, with their frame digests (thread-safe).

    Bounded by :data:`REMEMBERED_LOOKUPS` and :data:`REMEMBERED_TOKENS`, the oldest forgotten
    first. A forgotten lookup costs one more round trip: the client sends it whole.
    """

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, tuple[bytes, LookupQuery]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def put(self, query: LookupQuery) -> None:
        try:
            digest = lookup_digest(query)  # off the lock: it hashes the token ids
        except ValueError:  # pragma: no cover - a decoded query is within every limit
            return
        with self._lock:
            old = self._by_id.pop(query.req_id, None)
            if old is not None:
                self._tokens -= len(old[1].tokens)
            self._by_id[query.req_id] = (digest, query)
            self._tokens += len(query.tokens)
            while self._by_id and (
                len(self._by_id) > REMEMBERED_LOOKUPS or self._tokens > REMEMBERED_TOKENS
            ):
                _, (_, gone) = self._by_id.popitem(last=False)
                self._tokens -= len(gone.tokens)

    def get(self, again: Again) -> LookupQuery | None:
        """The lookup ``again`` names, or ``None`` (not remembered, or another digest)."""
        with self._lock:
            held = self._by_id.get(again.req_id)
            if held is None or held[0] != again.digest:
                return None
            self._by_id.move_to_end(again.req_id)
            return held[1]


_in_process: dict[Path, LookupServer] = {}
"""Live servers of this process by socket path: a client in the same process (the scheduler
and a single worker share vLLM's engine-core process) calls them directly."""
_in_process_lock = threading.Lock()


def local_server(path: Path) -> LookupServer | None:
    with _in_process_lock:
        return _in_process.get(path)


class LookupServer:
    """Answers lookups for one worker rank from daemon threads.

    A :class:`LookupClient` in the same process calls :meth:`answer` directly instead of going
    through the socket (same answers, same leases; no encoding round trip).

    Args:
        engine_key: ``engine_id + ":" + instance_id`` (names the socket folder).
        rank: This worker's tensor-parallel rank.
        lookup: Leading tokens present for a query; the worker leases them under
            ``query.req_id``. An exception (or a value outside ``[0, len(tokens)]``) answers -1.
        clear: Empties this rank's cache.
        base: Folder to put the socket folder in (default :func:`tempfile.gettempdir`).

    Attributes:
        path: The socket this server bound.

    Raises:
        PermissionError: The socket folder exists but is not a directory owned by this user.
        ValueError: The socket path is too long for ``AF_UNIX``.
    """

    def __init__(
        self,
        engine_key: str,
        rank: int,
        lookup: Callable[[LookupQuery], int],
        clear: Callable[[], None],
        *,
        base: str | os.PathLike[str] | None = None,
    ) -> None:
        self.path = socket_path(engine_key, rank, base=base)
        self._lookup = lookup
        self._clear = clear
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._failed_log = LogThrottle()
        self._remembered = _Remembered()
        self._identity = (-1, -1)  # (st_dev, st_ino) of the socket file once bound
        if len(os.fsencode(self.path)) > SUN_PATH_MAX:
            raise ValueError(
                f"lookup socket path {self.path} is {len(os.fsencode(self.path))} bytes; "
                f"AF_UNIX allows at most {SUN_PATH_MAX}: set TMPDIR (or base) to a shorter folder"
            )
        folder = self.path.parent
        with contextlib.suppress(FileExistsError):  # not a directory: reported just below
            folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(
                f"lookup socket folder {folder}: expected a directory owned by uid {os.getuid()}, "
                f"found {'a directory' if stat.S_ISDIR(info.st_mode) else 'a non-directory'} "
                f"owned by uid {info.st_uid}; remove it or set TMPDIR to a private folder"
            )
        os.chmod(folder, 0o700)
        self._replace_stale(rank)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(str(self.path))  # the 0700 folder guards it until the chmod
        except BaseException:
            self._sock.close()
            raise
        try:
            bound = os.lstat(self.path)
            self._identity = (bound.st_dev, bound.st_ino)
            os.chmod(self.path, 0o600)
            self._sock.listen(64)
        except BaseException:
            self._sock.close()
            self._unlink_own()
            raise
        self._thread = threading.Thread(
            target=self._serve, name=f"lmcache-lookup-rank{rank}", daemon=True
        )
        self._thread.start()
        with _in_process_lock:
            _in_process[self.path] = self

    def _replace_stale(self, rank: int) -> None:
        try:
            info = self.path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise FileExistsError(
                f"lookup socket path {self.path} exists and is not a socket; expected nothing "
                "or a stale socket there: remove it"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)
        try:
            probe.connect(str(self.path))
        except OSError:
            pass  # stale: nobody listens
        else:
            logger.warning(
                "lmcache lookup server rank %d: a live server already listens at %s (same "
                "engine key and rank); replacing its socket with this one",
                rank,
                self.path,
            )
        finally:
            probe.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._conns_lock:
                if self._closed.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(
                target=self._handle, args=(conn,), name="lmcache-lookup-conn", daemon=True
            ).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                conn.settimeout(None)  # an idle persistent connection may wait for ever
                first = conn.recv(1)
                if not first:
                    return
                conn.settimeout(_BODY_TIMEOUT_S)
                try:
                    request = decode_request_body(conn, first[0])
                except ValueError as exc:
                    logger.warning(
                        "lmcache lookup server %s: malformed request (%s); closing that "
                        "connection (expected the framing of lmcache_vllm.lookup_wire)",
                        self.path,
                        exc,
                    )
                    return
                except TimeoutError:
                    logger.warning(
                        "lmcache lookup server %s: a request stalled for %.0f s mid-way; "
                        "closing that connection",
                        self.path,
                        _BODY_TIMEOUT_S,
                    )
                    return
                except ConnectionError as exc:
                    logger.debug("lmcache lookup server %s: truncated request (%s)", self.path, exc)
                    return
                if isinstance(request, Again):
                    known = self._remembered.get(request)
                    reply = UNKNOWN if known is None else self.answer(known)
                else:
                    if request is not None:
                        self._remembered.put(request)
                    reply = self.answer(request)
                conn.sendall(REPLY.pack(reply))
        except OSError:
            return
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def answer(self, request: LookupQuery | None) -> int:
        """The reply to ``request`` (``None``: clear): hit tokens, 0, or -1 on failure."""
        if self._closed.is_set():
            return -1
        try:
            if request is None:
                self._clear()
                return 0
            answer = operator.index(self._lookup(request))
            if not 0 <= answer <= len(request.tokens):
                raise ValueError(
                    f"lookup callback returned {answer} for {len(request.tokens)} tokens; "
                    "expected a value in [0, n_tokens]"
                )
            return answer
        except Exception:
            held = self._failed_log.ready()
            if held is not None:
                logger.exception(
                    "lmcache lookup server %s: %s failed; answering -1 (a miss)%s",
                    self.path,
                    "clear" if request is None else "lookup",
                    f" ({held} more since the last report)" if held else "",
                )
            return -1

    def close(self) -> None:
        """Stop serving; remove the socket file if it is still the one this server bound.

        Idempotent. The folder is removed only when no other socket is left in it.
        """
        with _in_process_lock:
            if _in_process.get(self.path) is self:
                del _in_process[self.path]
        with self._conns_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for conn in conns:  # wake handlers blocked in recv; clients see EOF at once
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=1.0)
        self._unlink_own()

    def _unlink_own(self) -> None:
        """Unlink the socket if it is still the file this server bound; drop an empty folder."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            info = None
        if info is not None and (info.st_dev, info.st_ino) == self._identity:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # fails while another socket remains: left in place
