# SPDX-License-Identifier: Apache-2.0
"""The engine side of the node cache: one connection to the owner, and leases on the arena.

:class:`NodeClient` sends requests to the owner (:mod:`lmcache.node.server`) over its Unix
socket, each with a short timeout. When the owner is down, does not answer in time or answers
nonsense, the call returns ``None`` (the tier makes that a miss or a skipped store), the
connection is dropped, and no call tries again before a backoff (50 ms, doubling to 2 s) has
passed: a dead owner costs a request one refused ``connect``, a hung one the timeout, at most
once per backoff.

Leases on arena bytes are :class:`~lmcache.memory.MemoryLease` objects whose owner is the
client: releasing the last lease of an allocation queues a one-way ``Release`` for the owner,
sent with the next request, or by a flusher thread 10 ms later when none comes. After a reconnect the client
tells the owner which blocks it still holds, so leases lost with a timed-out reply are dropped.
Leases of an arena generation the client can no longer vouch for (the owner restarted, or forgot
the session) are *stale*: their bytes stay mapped until released, but are never committed.

With ``autostart`` the client starts an owner when none answers (``python -m lmcache.node
serve``, detached, logging to ``owner.log``); the owner's folder lock makes sure only one of
several engines starting at once keeps running.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import torch

from lmcache.devices import DeviceBackend
from lmcache.memory.lease import MemoryLease
from lmcache.node import wire
from lmcache.node.arena import (
    SOCKET_NAME,
    NodeCacheError,
    ensure_private_dir,
    map_arena,
)
from lmcache.node.leases import ArenaLeases, NodeAllocation, dtype_name, dtype_of, leading_alike
from lmcache.node.spawn import OwnerStarter

__all__ = ["NodeAllocation", "NodeClient", "dtype_name", "dtype_of"]

logger = logging.getLogger(__name__)

R = TypeVar("R")


class NodeClient(ArenaLeases):
    """One process's connection to a node cache owner (see the module docstring).

    Thread-safe: one request at a time on the socket.

    Args:
        folder: The node cache folder.
        budget_bytes: The arena size an owner started by this client gets.
        autostart: Start an owner when none answers.
        timeout_s: Seconds one request may take before it counts as failed.
        backend: Page-locks each arena mapping (``host_register``) when it is a device's.
        idle_exit_s: ``--idle-exit`` of an owner this client starts.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        budget_bytes: int,
        autostart: bool = True,
        timeout_s: float = 0.5,
        backend: DeviceBackend | None = None,
        idle_exit_s: float = 900.0,
    ) -> None:
        self.folder = ensure_private_dir(folder)
        self.budget_bytes = int(budget_bytes)
        self.autostart = autostart
        self.timeout_s = timeout_s
        self.idle_exit_s = idle_exit_s
        super().__init__(backend if backend is not None and backend.device_type != "cpu" else None)
        self._token = secrets.token_bytes(16)
        self._pid = os.getpid()
        self._io = threading.Lock()  # one request at a time on the socket
        self._sock: socket.socket | None = None
        self.welcome: wire.Welcome | None = None
        self._down_until = 0.0
        self._backoff = 0.05
        self._down_logged = False
        self.starter = OwnerStarter()
        self._closed = False
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None

    # ------------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self, wait_s: float = 0.0) -> bool:
        """Connect now (starting an owner if allowed), retrying for up to ``wait_s`` seconds."""
        deadline = time.monotonic() + wait_s
        self._down_logged = True  # an owner being started is not news; say so only at the end
        while True:
            with self._io:
                self._down_until = 0.0
                if self._ensure_connected():
                    if self._arena is not None and self._arena.pinning is not None:
                        self._arena.pinning.join()  # engines start with a pinned arena
                    return True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        logger.warning(
            "lmcache node cache: no owner answers at %s%s; node cache lookups are misses and "
            "stores are skipped until one does.",
            self.folder,
            ""
            if self.autostart
            else " (node_cache_autostart is false: start one with 'python -m lmcache.node serve')",
        )
        return False

    def close(self) -> None:
        """Drop the connection (the owner keeps this session's leases until it notices the
        process is gone, or for its grace period) and unpin the arena once nothing leases it."""
        with self._io:
            with self._lock:
                done = not self._holds  # ending the session releases what is pending
            if done and self._sock is not None:  # nothing leased: the owner may forget us now
                with contextlib.suppress(OSError):
                    self._sock.sendall(wire.encode(wire.Bye()))
            self._closed = True
            self._disconnect()
            with self._lock:
                arena, self._arena = self._arena, None
                if arena is not None:
                    self._retire_if_unused(arena)
        self._wake.set()
        self.starter.reap()

    def _ensure_connected(self) -> bool:
        """Under ``_io``: a connection to a welcoming owner, or ``False`` (down)."""
        if self._pid != os.getpid():  # a forked child: the connection and leases are the parent's
            self._disconnect()  # our copy of the descriptor; the parent keeps its own
            self._pid, self._token = os.getpid(), secrets.token_bytes(16)
            with self._lock:
                self._new_epoch()
        if self._sock is not None:
            return True
        if self._closed or time.monotonic() < self._down_until:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(str(self.folder / SOCKET_NAME))
            with self._lock:  # the holds stand for every release not yet sent
                holds = list(self._holds.items())
                self._pending.clear()
            generation = self._arena.generation if self._arena is not None else ""
            hello = wire.Hello(wire.PROTOCOL_VERSION, self._token, os.getpid(), generation, holds)
            sock.sendall(wire.encode(hello))
            reply = wire.decode_reply(wire.read_frame(sock))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if self.autostart:
                self.starter.start(self.folder, self.budget_bytes, self.idle_exit_s)
            self._mark_down(exc)
            return False
        except (OSError, wire.FrameError) as exc:
            sock.close()
            self._mark_down(exc)
            return False
        if not isinstance(reply, wire.Welcome):
            sock.close()
            self._mark_down(RuntimeError(f"owner answered {reply!r}"))
            return False
        try:
            self._adopt(reply)
        except (NodeCacheError, OSError, RuntimeError, ValueError) as exc:
            sock.close()
            self._mark_down(exc)
            return False
        self._sock = sock
        self._backoff = 0.05
        if self._down_logged:
            logger.info(
                "lmcache node cache: connected to the owner at %s (pid %d, %d bytes)",
                self.folder,
                reply.owner_pid,
                reply.budget_bytes,
            )
            self._down_logged = False
        return True

    def _adopt(self, welcome: wire.Welcome) -> None:
        """Map the welcomed generation's arena if it is new; retire what can't be vouched for."""
        if not os.path.samefile(Path(welcome.arena_path).parent, self.folder):
            raise NodeCacheError(
                f"node cache owner named arena {welcome.arena_path!r}: expected a file in "
                f"{str(self.folder)!r}"
            )
        same = self._arena is not None and self._arena.generation == welcome.generation
        if not same:
            arena = map_arena(welcome.arena_path, welcome.generation, welcome.arena_bytes)
            self._adopt_arena(arena, welcome.arena_bytes)
        elif not welcome.resumed:
            with self._lock:
                self._new_epoch()
        self.welcome = welcome
        self.budget_bytes = welcome.budget_bytes

    def _disconnect(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def _mark_down(self, exc: BaseException) -> None:
        self._disconnect()
        with self._lock:  # stores are skipped while the owner is away; a reconnect tells it
            self._outbox.clear()  # which blocks this process still holds
            self._pending.clear()
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 2.0)
        if not self._down_logged:
            logger.warning(
                "lmcache node cache: the owner at %s is unavailable (%s); node cache lookups "
                "are misses and stores are skipped until it answers again.",
                self.folder,
                exc,
            )
            self._down_logged = True

    # ------------------------------------------------------------------ requests

    def call(self, req: wire._Msg, expect: type[R]) -> R | None:
        """Send ``req`` and return its reply when it is an ``expect``; ``None`` when the owner is
        unavailable or answers otherwise (never raises for either)."""
        with self._io:
            reply = self._call_locked(req)
        self._drain()
        return reply if isinstance(reply, expect) else None

    def send(self, msg: wire._Msg) -> bool:
        """Send a one-way message; returns whether it was sent."""
        with self._io:
            ok = self._send_locked(msg)
        self._drain()
        return ok

    def _call_locked(self, req: wire._Msg) -> wire.Reply | None:
        if not self._send_locked(req):
            return None
        assert self._sock is not None
        try:
            reply = wire.decode_reply(wire.read_frame(self._sock))
        except (OSError, wire.FrameError) as exc:
            self._mark_down(exc)
            return None
        if isinstance(reply, wire.ErrorReply):
            logger.warning("lmcache node cache: the owner refused a request: %s", reply.message)
        return reply

    def _send_locked(self, msg: wire._Msg | None) -> bool:
        if not self._ensure_connected():
            return False
        assert self._sock is not None
        frames = self._take_queued()
        if msg is not None:
            frames.append(wire.encode(msg))
        try:
            self._sock.sendall(b"".join(frames))
        except OSError as exc:
            self._mark_down(exc)
            return False
        return True

    def _drain(self) -> None:
        """Send queued releases if the socket is free (else its holder sends them)."""
        while (self._pending or self._outbox) and not self._closed:
            if not self._io.acquire(blocking=False):
                return
            try:
                if self._sock is None:
                    return
                self._send_locked(None)
            finally:
                self._io.release()

    def get_many(self, keys: Sequence[bytes]) -> list[tuple[MemoryLease, wire.GetReply]]:
        """Leases on the longest run of leading ``keys`` that are ready (one request), each with
        its record; empty when the owner is unavailable."""
        out: list[tuple[MemoryLease, wire.GetReply]] = []
        with self._io:
            reply = self._call_locked(wire.GetMany([bytes(k) for k in keys[: wire.MAX_KEYS]]))
            chunks = reply.chunks if isinstance(reply, wire.GetManyReply) else []
            good = leading_alike(chunks)
            if good < len(chunks):
                self._send_locked(wire.Release([r.block for r in chunks[good:]]))
            if good:
                dtype = dtype_of(chunks[0].dtype)
                assert dtype is not None
                pairs = [(r.block, r.offset) for r in chunks[:good]]
                leases = self.lease_blocks(pairs, chunks[0].shape, dtype)
                for lease, record in zip(leases, chunks, strict=False):
                    lease._alloc.checksum = record.device_sum
                    out.append((lease, record))
        self._drain()
        return out

    def alloc(
        self, shape: Sequence[int], dtype: torch.dtype, count: int, protect: list[bytes]
    ) -> tuple[list[MemoryLease], int]:
        """Up to ``count`` fresh blocks as leases of ``shape``/``dtype``, and how many entries
        the owner evicted for them (nothing when it is unavailable)."""
        nbytes = math.prod(shape) * dtype.itemsize
        with self._io:
            reply = self._call_locked(wire.Alloc(nbytes, count, protect[: wire.MAX_KEYS]))
            if not isinstance(reply, wire.AllocReply):
                return [], 0
            leases = self.lease_blocks(reply.blocks, shape, dtype)
        self._drain()
        return leases, reply.evicted

    def _flush_soon(self) -> None:
        if self._flusher is None:
            self._flusher = threading.Thread(
                target=self._flush_loop, name="lmcache-node-release", daemon=True
            )
            self._flusher.start()
        if not self._wake.is_set():  # set() takes a lock: a hit releases 100s of leases at once
            self._wake.set()

    def _flush_loop(self) -> None:
        # Releases usually leave with the next request; this thread sends those of a client
        # that went quiet, after a short delay so that it never competes with a busy caller.
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            time.sleep(0.01)
            if (self._pending or self._outbox) and self._io.acquire(blocking=False):
                try:
                    if self._sock is not None:
                        self._send_locked(None)
                finally:
                    self._io.release()
                if self._pending or self._outbox:
                    self._wake.set()
