# SPDX-License-Identifier: Apache-2.0
"""Scheduler -> worker cache lookups over Unix-domain sockets.

vLLM asks the *scheduler-side* connector how many leading prompt tokens the external cache holds,
but the cache lives with the *workers* (one shard per tensor-parallel rank, possibly in other
processes). The lifecycle:

1. Each worker rank starts a :class:`LookupServer` once its KV caches are registered. The server
   binds ``socket_path(engine_key, rank)`` and answers from a daemon thread, one thread per
   connection, so one slow or stuck peer never blocks another.
2. The scheduler's :class:`LookupClient` keeps persistent connections per rank (one for each
   lookup in flight at once: lookups from several threads never wait for each other). A lookup
   sends the :class:`LookupQuery` to *every* rank at once, then collects the replies until *one*
   overall deadline (``timeout_s`` from the start of the call). The answer is the minimum over
   the ranks: a token counts only when every rank holds its shard. The worker leases the hit chunks under
   ``req_id`` when it answers, so the load that follows finds them. A rank whose server lives in
   the client's own process (vLLM's scheduler and a single worker share the engine-core
   process) is called directly: same answer, no socket round trip; when every rank is, no frame
   is packed either (the query's limits are checked, its token ids where their keys are made).
   With ``direct_deadline`` such a call runs on a daemon thread and is waited for until the
   same deadline: a worker stuck in a lookup is a miss, never a stuck caller (and after
   repeated timeouts the client backs off, asking nothing for a while, one log line).
3. :meth:`LookupClient.clear` asks every rank to empty its cache (``reset_prefix_cache``).
4. :meth:`LookupServer.close` stops serving and removes the socket file, but only if the file at
   the path is still the one it bound (a newer server may have replaced it).

Failures are misses, never errors. :meth:`LookupClient.lookup` never raises: a query that cannot
be encoded (a limit of the wire format exceeded, a token id outside ``[0, 2**32)``), a rank whose
socket is missing (not up yet, or gone), refused, closed, slow past the deadline, answering
garbage or answering ``-1`` all make the lookup return 0. Each such rank answer is counted in
:attr:`LookupClient.failures` and logged once per change of that rank's state, not once per call.
A missing socket is a miss at once (no waiting loop); the next call connects again. A rank that
misses the deadline has its connection closed, so its late reply can never be read as the answer
to a later request.

Where: ``<base>/lmcache-vllm-<uid>-<sha256(engine_key)[:16]>/rank<r>.sock``, with ``base``
defaulting to :func:`tempfile.gettempdir`. The engine key is
``kv_transfer_config.engine_id + ":" + vllm_config.instance_id``: the scheduler and the workers of
one engine share it, two engines (in one process or on one host) never do. The folder is ``0700``
and owned by this user (a server refuses any other folder; a client does not connect through
one); the socket is ``0600``. The digest keeps the path under the ~108-byte ``AF_UNIX`` limit.

Wire format: :mod:`lmcache_vllm.lookup_wire` (little-endian :mod:`struct` framing, no pickle;
every limit checked on both sides). Its public names are re-exported here.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import operator
import os
import selectors
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from lmcache.tiers.tier_guard import TierGuard, TierTimeout, TierUnavailable
from lmcache_vllm.lookup_wire import (
    MAX_EXTRA_KEY_BYTES,
    MAX_EXTRA_KEYS,
    MAX_ID_BYTES,
    MAX_SALT_BYTES,
    MAX_TOKENS,
    OP_CLEAR,
    OP_LOOKUP,
    REPLY,
    LookupQuery,
    check_lookup,
    decode_request,
    decode_request_body,
    encode_clear,
    encode_lookup,
)

__all__ = [
    "MAX_EXTRA_KEYS",
    "MAX_EXTRA_KEY_BYTES",
    "MAX_ID_BYTES",
    "MAX_SALT_BYTES",
    "MAX_TOKENS",
    "OP_CLEAR",
    "OP_LOOKUP",
    "LookupClient",
    "LookupQuery",
    "LookupServer",
    "decode_request",
    "encode_clear",
    "encode_lookup",
    "socket_dir",
    "socket_path",
]

logger = logging.getLogger(__name__)

_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_BODY_TIMEOUT_S = 10.0
"""Server side: once a request's first byte arrived, the rest must follow within this time."""
_LOG_EVERY_S = 60.0
"""Repeated errors of one kind that have no per-rank state are logged at most this often."""


def socket_dir(engine_key: str, *, base: str | os.PathLike[str] | None = None) -> Path:
    """The per-engine folder holding the rank sockets (not created here).

    Args:
        engine_key: ``engine_id + ":" + instance_id`` of the vLLM engine.
        base: Folder to put it in (default :func:`tempfile.gettempdir`).

    Returns:
        ``<base>/lmcache-vllm-<uid>-<sha256(engine_key)[:16]>``.
    """
    digest = hashlib.sha256(engine_key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    root = Path(base) if base is not None else Path(tempfile.gettempdir())
    return root / f"lmcache-vllm-{os.getuid()}-{digest}"


def socket_path(engine_key: str, rank: int, *, base: str | os.PathLike[str] | None = None) -> Path:
    """Socket of ``rank``'s lookup server for ``engine_key`` (see :func:`socket_dir`)."""
    return socket_dir(engine_key, base=base) / f"rank{rank}.sock"


class _Throttle:
    """Lets a repeated log line through at most once per ``every_s``; counts what it held back."""

    def __init__(self, every_s: float = _LOG_EVERY_S) -> None:
        self._every_s = every_s
        self._next = 0.0
        self._held = 0
        self._lock = threading.Lock()

    def ready(self) -> int | None:
        """Lines held back since the last one let through, or ``None`` to hold this one."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._held += 1
                return None
            self._next = now + self._every_s
            held, self._held = self._held, 0
            return held


def _unsafe_folder(folder: Path) -> str | None:
    """Why a client must not connect through ``folder``; ``None`` when it is private or absent."""
    try:
        info = folder.lstat()
    except FileNotFoundError:
        return None  # the connect reports the missing socket
    except OSError as exc:
        return f"cannot stat it ({exc.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.getuid():
        return f"it is owned by uid {info.st_uid}, expected {os.getuid()}"
    if stat.S_IMODE(info.st_mode) & 0o077:
        return f"its mode is {stat.S_IMODE(info.st_mode):04o}, expected 0700"
    return None


_in_process: dict[Path, LookupServer] = {}
"""Live servers of this process by socket path: a client in the same process (the scheduler
and a single worker share vLLM's engine-core process) calls them directly."""
_in_process_lock = threading.Lock()


def _local_server(path: Path) -> LookupServer | None:
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
        self._failed_log = _Throttle()
        self._identity = (-1, -1)  # (st_dev, st_ino) of the socket file once bound
        if len(os.fsencode(self.path)) > _SUN_PATH_MAX:
            raise ValueError(
                f"lookup socket path {self.path} is {len(os.fsencode(self.path))} bytes; "
                f"AF_UNIX allows at most {_SUN_PATH_MAX}: set TMPDIR (or base) to a shorter folder"
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
                conn.sendall(REPLY.pack(self.answer(request)))
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


_IDLE_CONNECTIONS = 4
"""Idle connections a client keeps per rank (one per lookup in flight at once, at most)."""


class _Rank:
    """Client-side view of one rank: its socket, idle connections and last reported state.

    A lookup takes an idle connection (or makes one) for its exchange and gives it back once
    the reply is in, so lookups from several threads run at once, each on its own connection.
    """

    __slots__ = ("idle", "path", "rank", "state")

    def __init__(self, rank: int, path: Path) -> None:
        self.rank = rank
        self.path = path
        self.idle: list[socket.socket] = []
        self.state = "unknown"

    @property
    def conn(self) -> socket.socket | None:
        """The idle connection the next exchange takes, if any."""
        return self.idle[-1] if self.idle else None

    def drop(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()


class _Exchange:
    """One request in flight to one rank."""

    __slots__ = ("conn", "out", "rank", "reply", "sent")

    def __init__(self, rank: _Rank, conn: socket.socket, payload: bytes) -> None:
        self.rank = rank
        self.conn = conn
        self.out = memoryview(payload)
        self.sent = 0
        self.reply = bytearray()


class LookupClient:
    """Asks every rank's :class:`LookupServer` in parallel and combines the answers.

    Thread-safe: lookups answered only by servers in this process run concurrently; those that
    go over the sockets are serialized by a lock (one connection per rank).

    Args:
        engine_key: ``engine_id + ":" + instance_id``, as given to the servers.
        world_size: Number of ranks (tensor-parallel size) to ask.
        timeout_s: Deadline of one whole call (every rank together), from its start.
        base: As for :class:`LookupServer`.
        in_process: Call the servers that live in this process directly (the default; vLLM's
            scheduler shares its process with a single worker). ``False`` always uses the
            sockets.
        direct_deadline: Run direct lookups on daemon threads under ``timeout_s`` (a late one
            is abandoned: a miss); after 3 in a row, ask nothing directly for 30 s. Without it
            a direct lookup runs on the caller's thread with no deadline of its own (for
            lookups that touch no disk or network: the worker's lookup waits at most 0.5 s,
            for a queued save of the same prompt).

    Attributes:
        paths: The ranks' socket paths.
        timeout_s: As given.
        failures: Rank answers that became misses (unreachable, late, garbage or -1), plus
            queries that could not be encoded, since construction.
        timeouts: Rank answers that missed the deadline (also in ``failures``).
    """

    def __init__(
        self,
        engine_key: str,
        world_size: int,
        *,
        timeout_s: float = 1.0,
        base: str | os.PathLike[str] | None = None,
        in_process: bool = True,
        direct_deadline: bool = False,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"LookupClient world_size is {world_size}; expected at least 1")
        if not timeout_s > 0:
            raise ValueError(f"LookupClient timeout_s is {timeout_s}; expected a positive value")
        self.paths = [socket_path(engine_key, r, base=base) for r in range(world_size)]
        self.timeout_s = timeout_s
        self.failures = 0
        self.timeouts = 0
        self._ranks = [_Rank(r, p) for r, p in enumerate(self.paths)]
        self._lock = threading.Lock()  # the ranks' idle connections
        self._state_lock = threading.Lock()  # counters and each rank's reported state
        self._closed = False
        self._bad_query_log = _Throttle()
        self._in_process = in_process
        self._direct: TierGuard | None = None
        if direct_deadline:
            self._direct = TierGuard("lookup", timeout_s, label="lmcache lookup")
            self._direct.breaker.describe = "the worker rank(s) in this process"

    def lookup(self, query: LookupQuery) -> int:
        """Leading tokens every rank holds; 0 on any failure. Never raises.

        Args:
            query: The request; every rank leases its hit chunks under ``query.req_id``.

        Returns:
            The minimum over the ranks of their hit tokens, or 0 when the query cannot be encoded
            or any rank misses the deadline, is unreachable or answers garbage or -1.
        """
        deadline = time.monotonic() + self.timeout_s
        try:
            servers = self._servers()
            if all(server is not None for server in servers):
                check_lookup(query)  # nothing goes on the wire: the limits only, no packing
                payload = b""
            else:
                payload = encode_lookup(query)
            limit = len(query.tokens)
        except Exception as exc:
            self._bad_query(query, exc)
            return 0
        try:
            if self._closed:
                return 0
            if not payload:  # every rank in this process: no socket, no lock
                answers: list[int | None] = [None] * len(self._ranks)
                for rank, server in zip(self._ranks, servers, strict=True):
                    assert server is not None
                    self._answer_local(rank, server, query, limit, answers)
            else:
                answers = self._exchange(payload, deadline, limit, query, servers)
        except Exception:  # a bug here must still not reach vLLM's scheduler
            logger.exception("lmcache lookup: unexpected error; counting a miss")
            with self._state_lock:
                self.failures += 1
            return 0
        if any(a is None for a in answers):
            return 0
        return min(a for a in answers if a is not None)

    def _servers(self) -> list[LookupServer | None]:
        """Per rank, its server when it lives in this process (answered by a direct call)."""
        if not self._in_process:
            return [None] * len(self._ranks)
        return [_local_server(rank.path) for rank in self._ranks]

    def clear(self) -> bool:
        """Ask every rank to empty its cache, under the same deadline as a lookup.

        Returns:
            True when every rank answered OK in time (a late rank may still clear).
        """
        deadline = time.monotonic() + self.timeout_s
        try:
            if self._closed:
                return False
            answers = self._exchange(encode_clear(), deadline, 0, None, self._servers())
        except Exception:
            logger.exception("lmcache lookup: unexpected error in clear")
            return False
        return all(a is not None for a in answers)

    def close(self) -> None:
        """Close the connections (idempotent); later calls miss."""
        with self._lock:
            self._closed = True
            for rank in self._ranks:
                rank.drop()
        if self._direct is not None:
            self._direct.close()

    def _bad_query(self, query: object, exc: Exception) -> None:
        with self._state_lock:
            self.failures += 1
        held = self._bad_query_log.ready()
        if held is None:
            return
        req_id = getattr(query, "req_id", None)
        logger.warning(
            "lmcache lookup: cannot encode the query of request %.80r (%s); counting 0 hit "
            "tokens%s",
            req_id,
            exc,
            f" ({held} more such queries since the last report)" if held else "",
        )

    def _note(self, rank: _Rank, state: str, detail: str = "") -> None:
        """Record ``rank``'s outcome; log only when its state changes."""
        with self._state_lock:
            if state != "ok":
                self.failures += 1
            if state == "timeout":
                self.timeouts += 1
            if state == rank.state:
                return
            previous, rank.state = rank.state, state
        if state == "ok":
            if previous != "unknown":
                logger.info("lmcache lookup: rank %d (%s) answers again", rank.rank, rank.path)
            return
        level = logging.INFO if previous == "unknown" and state == "no socket" else logging.WARNING
        logger.log(
            level,
            "lmcache lookup: rank %d (%s): %s%s; counting 0 hit tokens until it answers "
            "(logged once per change; is the worker of this engine key running?)",
            rank.rank,
            rank.path,
            state,
            f" ({detail})" if detail else "",
        )

    def _connection(self, rank: _Rank) -> socket.socket | None:
        """A connected, idle, non-blocking socket to ``rank`` for one exchange (give it back
        with :meth:`_give_back`), or ``None`` (noted as a miss)."""
        while True:
            with self._lock:
                if self._closed:
                    return None
                conn = rank.idle.pop() if rank.idle else None
            if conn is None:
                break
            try:
                conn.recv(1, socket.MSG_PEEK)  # idle: nothing to read, not closed
            except BlockingIOError:
                return conn
            except OSError:
                pass
            conn.close()  # closed by the server, or bytes nobody asked for: try the next
        problem = _unsafe_folder(rank.path.parent)
        if problem is not None:
            self._note(rank, "unsafe folder", f"{rank.path.parent}: {problem}; not connecting")
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.setblocking(False)
        try:
            conn.connect(str(rank.path))
        except FileNotFoundError:
            state, detail = "no socket", ""
        except ConnectionRefusedError:
            state, detail = "refused", "stale socket: nobody listens"
        except BlockingIOError:
            state, detail = "busy", "listen backlog full"
        except OSError as exc:
            state, detail = "connect failed", exc.strerror or type(exc).__name__
        else:
            return conn
        conn.close()
        self._note(rank, state, detail)
        return None

    def _give_back(self, rank: _Rank, conn: socket.socket) -> None:
        """``conn`` answered its exchange in full: keep it for the next one."""
        with self._lock:
            if not self._closed and len(rank.idle) < _IDLE_CONNECTIONS:
                rank.idle.append(conn)
                return
        conn.close()

    def _exchange(
        self,
        payload: bytes,
        deadline: float,
        limit: int,
        request: LookupQuery | None,
        servers: list[LookupServer | None],
    ) -> list[int | None]:
        """Send ``payload`` to every rank, collect ``i64`` replies until ``deadline``; ranks
        served in this process (``servers``, from :meth:`_servers`) answer ``request``
        (``None``: clear) by a direct call.

        Returns:
            Per rank, its answer in ``[0, limit]``, or ``None`` for a miss.
        """
        answers: list[int | None] = [None] * len(self._ranks)
        local = []
        remote = []
        for rank, server in zip(self._ranks, servers, strict=True):
            if server is not None:
                local.append((rank, server))
            else:
                remote.append(rank)
        if not remote:  # one worker in this process (vLLM's usual single-GPU case)
            for rank, server in local:
                self._answer_local(rank, server, request, limit, answers)
            return answers
        with selectors.DefaultSelector() as sel:
            for rank in remote:
                conn = self._connection(rank)
                if conn is not None:
                    sel.register(conn, selectors.EVENT_WRITE, _Exchange(rank, conn, payload))
            for rank, server in local:  # the remote ranks work meanwhile
                self._answer_local(rank, server, request, limit, answers)
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for key, events in sel.select(remaining):
                    ex: _Exchange = key.data
                    conn = ex.conn
                    try:
                        if events & selectors.EVENT_WRITE:
                            ex.sent += conn.send(ex.out[ex.sent :])
                            if ex.sent == len(ex.out):
                                sel.modify(conn, selectors.EVENT_READ, ex)
                            continue
                        part = conn.recv(REPLY.size - len(ex.reply))
                    except BlockingIOError:
                        continue
                    except OSError as exc:
                        sel.unregister(conn)
                        conn.close()
                        self._note(ex.rank, "connection lost", exc.strerror or str(exc))
                        continue
                    if not part:
                        sel.unregister(conn)
                        conn.close()
                        self._note(ex.rank, "connection lost", "closed by the server")
                        continue
                    ex.reply += part
                    if len(ex.reply) < REPLY.size:
                        continue
                    sel.unregister(conn)
                    (value,) = REPLY.unpack(ex.reply)
                    if -1 <= value <= limit:
                        self._give_back(ex.rank, conn)
                    else:
                        conn.close()  # out of step with this server: start afresh
                    self._accept(ex.rank, value, limit, answers)
            for key in list(sel.get_map().values()):
                ex = key.data
                sel.unregister(key.fileobj)
                ex.conn.close()  # a late reply must never answer a later request
                self._note(ex.rank, "timeout", f"no answer within {self.timeout_s:g} s of the call")
        return answers

    def _answer_local(
        self,
        rank: _Rank,
        server: LookupServer,
        request: LookupQuery | None,
        limit: int,
        answers: list[int | None],
    ) -> None:
        """``rank``'s answer from its server in this process: a direct call, under the deadline
        with ``direct_deadline`` (a clear, ``request`` ``None``, is always waited for)."""
        if self._direct is None or request is None:
            self._accept(rank, server.answer(request), limit, answers)
            return
        try:
            value = self._direct.call(partial(server.answer, request))
        except TierTimeout:
            self._note(
                rank, "timeout", f"no answer within {self.timeout_s:g} s in this process; abandoned"
            )
            return
        except TierUnavailable as exc:
            self._note(rank, "backing off", str(exc))
            return
        self._accept(rank, value, limit, answers)

    def _accept(self, rank: _Rank, value: int, limit: int, answers: list[int | None]) -> None:
        """Record ``rank``'s reply ``value``: an answer in ``[0, limit]``, else a miss."""
        if 0 <= value <= limit:
            answers[rank.rank] = value
            self._note(rank, "ok")
        elif value == -1:
            self._note(rank, "server error", "the worker's lookup failed")
        else:
            self._note(rank, "bad reply", f"{value} for {limit} tokens")
