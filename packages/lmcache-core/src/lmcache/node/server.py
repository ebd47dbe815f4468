# SPDX-License-Identifier: Apache-2.0
"""The node cache owner: one process per folder that owns the arena's index and leases.

It listens on the folder's Unix socket (mode 0600, in a 0700 folder; a peer of another uid is
refused through ``SO_PEERCRED`` as well) and serves every engine process of the node, one event
loop, no threads. Each engine process is a *session* (a random token it sends in its
:class:`~lmcache.node.wire.Hello`). A session's leases outlive a dropped connection while its
process lives, so a client that timed out and reconnected keeps them; they are all reclaimed as
soon as the process is gone (SIGKILL included), or after ``grace_s`` seconds without a
connection. A frame that is malformed, oversized or not a known message closes that connection
only.

Run it as ``python -m lmcache.node serve`` (:mod:`lmcache.node.__main__`) or let the first
engine start it (:mod:`lmcache.node.client`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import selectors
import socket
import time
from pathlib import Path

from lmcache.node import wire
from lmcache.node.arena import (
    HEADER_BYTES,
    LOCK_NAME,
    SOCKET_NAME,
    ArenaFile,
    NodeCacheError,
    create_arena,
    ensure_private_dir,
    private_file,
    remove_stale_arenas,
)
from lmcache.node.index import ALIGNMENT, Entry, NodeIndex, chunk_nbytes
from lmcache.node.sessions import PEERCRED, Conn, Session, process_gone

__all__ = ["NodeServer", "OwnerRunning"]

logger = logging.getLogger(__name__)


class OwnerRunning(NodeCacheError):
    """Another owner holds the folder's lock."""


class NodeServer:
    """The owner of one node cache folder.

    Args:
        folder: The node cache folder (created 0700 if needed).
        budget_bytes: Size of the arena: the node's host cache budget.
        grace_s: Seconds a live process's leases outlast its connection.
        idle_exit_s: Exit after this many seconds without any session (0: never).

    Raises:
        NodeCacheError: a folder or arena that cannot be used; :class:`OwnerRunning` when
            another owner holds the folder (from :meth:`start`).
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        budget_bytes: int,
        *,
        grace_s: float = 10.0,
        idle_exit_s: float = 0.0,
    ) -> None:
        if budget_bytes < 4096:
            raise NodeCacheError(
                f"node cache budget: expected at least 4096 bytes, found {budget_bytes}. "
                "Pass --budget-bytes (or max_local_cpu_size) large enough for some chunks."
            )
        self.folder = ensure_private_dir(folder)
        self.budget_bytes = int(budget_bytes) // ALIGNMENT * ALIGNMENT  # any dtype views it
        self.grace_s = grace_s
        self.idle_exit_s = idle_exit_s
        self.arena: ArenaFile | None = None
        self.index = NodeIndex(self.budget_bytes)
        self._sessions: dict[bytes, Session] = {}
        self._conns: dict[int, Conn] = {}
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._lock_fd = -1
        self._stopping = False
        self._idle_since = time.monotonic()
        self._swept = 0.0

    # ------------------------------------------------------------------ lifecycle

    @property
    def socket_path(self) -> Path:
        return self.folder / SOCKET_NAME

    def start(self) -> None:
        """Take the folder's lock, start a new arena generation, listen."""
        fd = private_file(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OwnerRunning(
                f"node cache folder {str(self.folder)!r} has a running owner already "
                f"({LOCK_NAME} is locked); engines use that one."
            ) from None
        self._lock_fd = fd
        try:
            remove_stale_arenas(self.folder)
            self.arena = create_arena(self.folder, self.budget_bytes)
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)
            try:
                listener.bind(str(self.socket_path))
            finally:
                os.umask(old)
            os.chmod(self.socket_path, 0o600)
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            self.close()
            raise
        self._listener = listener
        self._sel.register(listener, selectors.EVENT_READ, None)
        logger.info(
            "lmcache node cache owner: pid %d, %d bytes, generation %s, socket %s",
            os.getpid(),
            self.budget_bytes,
            self.arena.generation,
            self.socket_path,
        )

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (safe from a signal handler)."""
        self._stopping = True

    def close(self) -> None:
        """Stop listening, remove the socket and the arena file, release the lock."""
        for conn in list(self._conns.values()):
            self._close_conn(conn)
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        if self.arena is not None:
            with contextlib.suppress(FileNotFoundError):
                self.arena.path.unlink()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def serve_forever(self, poll_s: float = 0.2) -> None:
        """Serve until :meth:`stop`, or ``idle_exit_s`` without sessions; then :meth:`close`."""
        try:
            while not self._stopping:
                for sel_key, events in self._sel.select(poll_s):
                    if sel_key.data is None:
                        self._accept()
                    else:
                        self._service(sel_key.data, events)
                self._sweep()
        finally:
            self.close()

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: the engines retry later
                logger.warning("node cache: accept failed: %s", exc)
                return
            try:
                creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
            except OSError:
                sock.close()
                continue
            pid, uid, _ = PEERCRED.unpack(creds)
            if uid != os.getuid():
                logger.warning("node cache: refused a connection of uid %d (pid %d)", uid, pid)
                sock.close()
                continue
            sock.setblocking(False)
            conn = Conn(sock, pid)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _service(self, conn: Conn, events: int) -> None:
        if events & selectors.EVENT_WRITE and not self._flush(conn):
            return
        if not events & selectors.EVENT_READ:
            return
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close_conn(conn)
            return
        try:
            for body in conn.reader.feed(data):
                if conn.sock.fileno() < 0:
                    return  # closed by the frame before (Bye)
                self._handle(conn, wire.decode_request(body))
        except wire.FrameError as exc:
            logger.warning("node cache: closing the connection of pid %d: %s", conn.pid, exc)
            self._close_conn(conn)
            return
        except Exception:  # a bug must cost one connection, not every engine's cache
            logger.exception("node cache: closing the connection of pid %d", conn.pid)
            self._close_conn(conn)
            return
        self._flush(conn)

    def _send(self, conn: Conn, msg: wire._Msg) -> None:
        if len(conn.out) > 64 * wire.MAX_FRAME_BYTES:
            raise wire.FrameError("the client does not read its replies")
        conn.out += wire.encode(msg)

    def _flush(self, conn: Conn) -> bool:
        """Send what is queued; returns whether the connection is still open."""
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
                del conn.out[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close_conn(conn)
                return False
        writing = bool(conn.out)
        if writing != conn.writing and conn.sock.fileno() in self._conns:
            mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0)
            self._sel.modify(conn.sock, mask, conn)
            conn.writing = writing
        return True

    def _close_conn(self, conn: Conn) -> None:
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is None:
            return
        self._sel.unregister(conn.sock)
        conn.sock.close()
        session = conn.session
        if session is not None and session.conn is conn:
            session.conn = None
            session.detached_at = time.monotonic()
            if process_gone(session.pid):
                self._end_session(session)

    def _end_session(self, session: Session) -> None:
        self._sessions.pop(session.token, None)
        held = self.index.release_all(session.leases)
        if held:
            logger.info("node cache: reclaimed %d blocks of pid %d", held, session.pid)

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._swept < 0.2:
            return  # a few times a second is enough, and keeps requests cheap
        self._swept = now
        for session in list(self._sessions.values()):
            if session.conn is None and (
                now - session.detached_at > self.grace_s or process_gone(session.pid)
            ):
                self._end_session(session)
        if self._sessions or self._conns:
            self._idle_since = now
        elif self.idle_exit_s > 0 and now - self._idle_since > self.idle_exit_s:
            logger.info("node cache: no engine for %.0f s, exiting", self.idle_exit_s)
            self._stopping = True

    # ------------------------------------------------------------------ requests

    def _handle(self, conn: Conn, req: wire.Request) -> None:
        session = conn.session
        if session is None:
            if not isinstance(req, wire.Hello):
                raise wire.FrameError(f"expected Hello first, found {type(req).__name__}")
            self._hello(conn, req)
            return
        index, leases = self.index, session.leases
        if isinstance(req, wire.Missing):
            self._send(conn, wire.MissingReply(index.missing(req.keys)))
        elif isinstance(req, wire.GetMany):
            chunks = []
            for key in req.keys:
                entry = index.get(leases, key)
                if entry is None:
                    break
                chunks.append(_get_reply(entry))
            self._send(conn, wire.GetManyReply(chunks))
        elif isinstance(req, wire.Alloc):
            blocks, evicted = index.alloc(leases, req.nbytes, req.count, frozenset(req.protect))
            self._send(conn, wire.AllocReply([(b.id, b.offset) for b in blocks], evicted))
        elif isinstance(req, wire.Commit):
            self._commit(session, req)
        elif isinstance(req, wire.Release):
            for block_id in req.blocks:
                index.release(leases, block_id)
        elif isinstance(req, wire.Touch):
            index.order.touch_chain(req.keys)
        elif isinstance(req, wire.Drop):
            index.remove(req.key, req.block)
        elif isinstance(req, wire.Remove):
            self._send(conn, wire.BoolReply(index.remove(req.key)))
        elif isinstance(req, wire.Clear):
            self._send(conn, wire.CountReply(index.clear(req.owner)))
        elif isinstance(req, wire.IsOrphan):
            self._send(conn, wire.BoolReply(index.order.is_orphan(req.key)))
        elif isinstance(req, wire.Stats):
            self._send(conn, self._stats())
        elif isinstance(req, wire.Bye):
            self._end_session(session)
            conn.session = None
            self._close_conn(conn)
        else:  # a second Hello
            raise wire.FrameError(f"unexpected {type(req).__name__} on an open session")

    def _hello(self, conn: Conn, req: wire.Hello) -> None:
        assert self.arena is not None
        if req.version != wire.PROTOCOL_VERSION:
            self._send(
                conn,
                wire.ErrorReply(
                    f"protocol version {req.version}, expected {wire.PROTOCOL_VERSION}: the "
                    "engine and the node cache owner come from different lmcache versions"
                ),
            )
            return
        session = self._sessions.get(req.session)
        resumed = session is not None and req.generation == self.arena.generation
        if session is None:
            session = Session(req.session, conn.pid)
            self._sessions[req.session] = session
        elif session.conn is not None and session.conn is not conn:
            stale = session.conn
            session.conn = None
            self._close_conn(stale)  # the client gave it up before we saw it close
        session.conn = conn
        session.pid = conn.pid
        conn.session = session
        if resumed:
            self.index.reconcile(session.leases, req.holds)
        self._send(
            conn,
            wire.Welcome(
                self.arena.generation,
                str(self.arena.path),
                self.arena.data_bytes,
                HEADER_BYTES,
                self.budget_bytes,
                os.getpid(),
                resumed,
            ),
        )

    def _commit(self, session: Session, req: wire.Commit) -> None:
        block = self.index.block(req.block)
        if block is None:
            logger.debug("node cache: commit of unknown block %d ignored", req.block)
            return
        nbytes = chunk_nbytes(req.shape, req.dtype)
        if nbytes is None:
            logger.debug("node cache: commit with unknown dtype %r ignored", req.dtype)
            return
        entry = Entry(
            block, nbytes, list(req.shape), req.dtype, req.checksum, req.device_sum, req.owner
        )
        why = self.index.commit(session.leases, req.block, req.key, req.parent, entry)
        if why is not None:
            logger.debug("node cache: commit of pid %d ignored: %s", session.pid, why)

    def _stats(self) -> wire.StatsReply:
        index = self.index
        assert self.arena is not None
        return wire.StatsReply(
            len(index.entries),
            index.used,
            self.budget_bytes,
            len(self._sessions),
            sum(1 for s in self._sessions.values() if s.conn is not None),
            index.leased_blocks(),
            index.evicted,
            self.arena.generation,
        )


def _get_reply(entry: Entry) -> wire.GetReply:
    return wire.GetReply(
        entry.block.id,
        entry.block.offset,
        entry.nbytes,
        entry.shape,
        entry.dtype,
        entry.checksum,
        entry.device_sum,
    )
