# SPDX-License-Identifier: Apache-2.0
"""Starting a node cache owner from an engine (``autostart``).

The owner runs detached (its own session, stdin closed, output appended to the folder's
``owner.log``), so it outlives the engine that started it and serves the engines after it. Two
engines that start one each at the same time are harmless: the second owner finds the folder
locked and exits at once.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from lmcache.node.arena import LOG_NAME, private_file

__all__ = ["OwnerStarter", "owner_command", "spawn_owner"]

logger = logging.getLogger("lmcache.node.client")


def owner_command(folder: Path, budget_bytes: int, idle_exit_s: float) -> list[str]:
    """The command line of an owner of ``folder`` with an arena of ``budget_bytes``."""
    return [
        sys.executable,
        "-m",
        "lmcache.node",
        "serve",
        "--dir",
        str(folder),
        "--budget-bytes",
        str(int(budget_bytes)),
        "--idle-exit",
        str(idle_exit_s),
    ]


def spawn_owner(
    folder: Path, budget_bytes: int, idle_exit_s: float
) -> subprocess.Popen[bytes] | None:
    """Start an owner in the background; returns it (poll it now and then to reap it), or
    ``None`` when it could not be started (logged)."""
    try:
        log = private_file(folder / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            child = subprocess.Popen(
                owner_command(folder, budget_bytes, idle_exit_s),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            os.close(log)
    except OSError as exc:
        logger.warning("lmcache node cache: could not start an owner (%s)", exc)
        return None
    logger.info("lmcache node cache: started an owner (pid %d) for %s", child.pid, folder)
    return child


class OwnerStarter:
    """Starts owners for one client: at most one every ``every_s`` seconds, reaping the ones
    that exited (a second owner of a folder exits at once)."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self.children: list[subprocess.Popen[bytes]] = []
        self._last = -1e9

    def start(self, folder: Path, budget_bytes: int, idle_exit_s: float) -> None:
        self.reap()
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        child = spawn_owner(folder, budget_bytes, idle_exit_s)
        if child is not None:
            self.children.append(child)

    def reap(self) -> None:
        self.children = [c for c in self.children if c.poll() is None]
