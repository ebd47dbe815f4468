# SPDX-License-Identifier: Apache-2.0
"""The scheduler side of a scheduler -> worker lookup: :class:`LookupClient`.

It asks every worker rank at once and takes the minimum of their answers under one deadline.
Every failure is a miss, and :meth:`LookupClient.lookup` never raises.
:mod:`lmcache_vllm.lookup_sockets` walks through the whole exchange.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from lmcache.tiers.tier_guard import TierGuard, TierTimeout, TierUnavailable
from lmcache_vllm.lookup_sockets import LogThrottle, socket_path, unsafe_folder
from lmcache_vllm.lookup_wire import (
    REPLY,
    UNKNOWN,
    LookupQuery,
    check_lookup,
    encode_clear,
)
from lmcache_vllm.scheduler.sent_lookups import SentLookups
from lmcache_vllm.worker.lookup_server import LookupServer, local_server

__all__ = ["LookupClient"]

logger = logging.getLogger(__name__)


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
    """One request in flight to one rank; ``whole`` frames the lookup whole when ``payload``
    only names it (:data:`~lmcache_vllm.lookup_wire.OP_AGAIN`) and the rank does not know it."""

    __slots__ = ("conn", "out", "rank", "reply", "sent", "whole")

    def __init__(
        self,
        rank: _Rank,
        conn: socket.socket,
        payload: bytes,
        whole: Callable[[], bytes] | None = None,
    ) -> None:
        self.rank = rank
        self.conn = conn
        self.out = memoryview(payload)
        self.sent = 0
        self.reply = bytearray()
        self.whole = whole

    def send_whole(self) -> None:
        """Start over with the whole lookup (the rank answered ``UNKNOWN``)."""
        assert self.whole is not None
        self.out = memoryview(self.whole())
        self.whole = None
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
        self._sent = SentLookups()
        self._bad_query_log = LogThrottle()
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
        whole: Callable[[], bytes] | None = None
        try:
            servers = self._servers()
            if all(server is not None for server in servers):
                check_lookup(query)  # nothing goes on the wire: the limits only, no packing
                payload = b""
            else:
                payload, whole = self._sent.payload(query)
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
                answers = self._exchange(payload, deadline, limit, query, servers, whole)
        except Exception:  # a bug here must still not reach vLLM's scheduler
            logger.exception("lmcache lookup: unexpected error; counting a miss")
            with self._state_lock:
                self.failures += 1
            return 0
        if any(a is None for a in answers):
            if whole is not None:  # e.g. a rank that cannot read OP_AGAIN: next time, whole
                self._sent.forget(query.req_id)
            return 0
        return min(a for a in answers if a is not None)

    def forget(self, req_id: str) -> None:
        """Forget what was sent for ``req_id`` (it ended)."""
        self._sent.forget(req_id)

    def _servers(self) -> list[LookupServer | None]:
        """Per rank, its server when it lives in this process (answered by a direct call)."""
        if not self._in_process:
            return [None] * len(self._ranks)
        return [local_server(rank.path) for rank in self._ranks]

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
        problem = unsafe_folder(rank.path.parent)
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
        whole: Callable[[], bytes] | None = None,
    ) -> list[int | None]:
        """Send ``payload`` to every rank, collect ``i64`` replies until ``deadline``; ranks
        served in this process (``servers``, from :meth:`_servers`) answer ``request``
        (``None``: clear) by a direct call. A rank that answers ``UNKNOWN`` to a ``payload``
        that names a lookup sent before gets ``whole()``, the lookup framed whole.

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
                    exchange = _Exchange(rank, conn, payload, whole)
                    sel.register(conn, selectors.EVENT_WRITE, exchange)
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
                    (value,) = REPLY.unpack(ex.reply)
                    if value == UNKNOWN and ex.whole is not None:
                        ex.send_whole()  # the rank does not remember it: send it whole
                        sel.modify(conn, selectors.EVENT_WRITE, ex)
                        continue
                    sel.unregister(conn)
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
