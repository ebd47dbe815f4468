# SPDX-License-Identifier: Apache-2.0
"""Who the node cache owner is serving: engine processes (sessions) and their connections.

A session outlives a dropped connection while its process lives (:func:`process_gone`), so a
client that reconnects keeps its leases.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass, field

from lmcache.node import wire
from lmcache.node.index import Leases

__all__ = ["PEERCRED", "Conn", "Session", "process_gone"]

PEERCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(eq=False)
class Session:
    """One engine process (its random token), its leases, and its connection if it has one."""

    token: bytes
    pid: int
    leases: Leases = field(default_factory=Leases)
    conn: Conn | None = None
    detached_at: float = 0.0


@dataclass(eq=False)
class Conn:
    """One accepted connection: its peer pid (``SO_PEERCRED``), input and queued replies."""

    sock: socket.socket
    pid: int
    reader: wire.FrameReader = field(default_factory=wire.FrameReader)
    out: bytearray = field(default_factory=bytearray)
    session: Session | None = None
    writing: bool = False  # registered for EVENT_WRITE (replies queued)


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")
