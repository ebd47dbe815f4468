# SPDX-License-Identifier: Apache-2.0
"""One real ``redis-server`` (or ``valkey-server``) process for tests, and how to find one.

:class:`RedisServer` runs on ``127.0.0.1``, on a free port, with its own temporary folder and
no persistence. It can be paused (SIGSTOP), stopped and started again on the same port.
Its process is killed when the object is garbage-collected or the interpreter exits.
:func:`redis_server_path` and :func:`redis_cli_path` find the binaries
(``$LMCACHE_REDIS_SERVER`` first). :mod:`lmcache.testing.redis_server` is the public import path.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar
from urllib.parse import quote

from lmcache.testing.resp import HOST, resp_command

__all__ = ["RedisServer", "redis_cli_path", "redis_server_path"]

_T = TypeVar("_T")


def redis_server_path() -> str | None:
    """The ``redis-server``/``valkey-server`` binary (``$LMCACHE_REDIS_SERVER`` first), or None."""
    explicit = os.environ.get("LMCACHE_REDIS_SERVER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("redis-server") or shutil.which("valkey-server")


def redis_cli_path() -> str | None:
    """The ``redis-cli``/``valkey-cli`` beside the server binary or on ``PATH``, or None."""
    server = redis_server_path()
    names = ("redis-cli", "valkey-cli")
    if server is not None:
        for name in names:
            candidate = Path(server).with_name(name)
            if os.access(candidate, os.X_OK):
                return str(candidate)
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_port(cluster: bool = False) -> int:
    """A free TCP port; for a cluster node one <= 55535 whose bus port (+10000) is free too."""
    if not cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port: int = sock.getsockname()[1]
            return port
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55536)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


def conf_quoted(value: str) -> str:
    """``value`` as a double-quoted redis.conf string."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class StartedOnEnter(ABC):
    """Context manager: :meth:`start` on enter (:meth:`cleanup` if that fails), :meth:`cleanup`
    on exit."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def cleanup(self) -> None: ...

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


def wait_for(
    probe: Callable[[], _T], done: Callable[[_T], bool], timeout: float, what: str
) -> None:
    """Call ``probe`` every 50 ms until ``done(result)``; after ``timeout`` s raise
    ``RuntimeError(f"{what}: {result!r}")``."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if done(found):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {found!r}")
        time.sleep(0.05)


class RedisServer(StartedOnEnter):
    """A real ``redis-server`` on ``127.0.0.1`` (context manager: started on enter).

    Args:
        password: ``requirepass`` (written to a 0600 config file, not the command line).
        unixsocket: Also listen on a unix socket (``unix_url``).
        args: Extra ``redis-server`` arguments, e.g. ``("--maxmemory", "10mb")``.
        port: The port; a free one when ``None``.
        binary: The server binary; :func:`redis_server_path` when ``None``.

    Attributes:
        port: The TCP port (kept across :meth:`stop` / :meth:`start`).
        dir: The server's temporary folder (removed by :meth:`cleanup` / ``__exit__``).
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        unixsocket: bool = False,
        args: Sequence[str] = (),
        port: int | None = None,
        binary: str | None = None,
    ) -> None:
        found = binary or redis_server_path()
        if found is None:
            raise RuntimeError(
                "RedisServer: no redis-server or valkey-server found; install one (Debian: "
                "apt-get install redis-server) or set LMCACHE_REDIS_SERVER to its path."
            )
        self.binary = found
        self.password = password
        cluster = "--cluster-enabled" in args
        self.port = port if port is not None else _free_port(cluster)
        self.dir = Path(tempfile.mkdtemp(prefix="lmcache-redis-"))
        self._unixsocket = self.dir / "redis.sock" if unixsocket else None
        self._args = tuple(args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._config = self.dir / "redis.conf"
        lines = [
            f"bind {HOST}",
            f"port {self.port}",
            f"dir {self.dir}",
            "save ''",
            "appendonly no",
            "daemonize no",
            f"logfile {self.dir / 'redis.log'}",
        ]
        if password is not None:
            lines.append(f"requirepass {conf_quoted(password)}")
        if self._unixsocket is not None:
            lines += [f"unixsocket {self._unixsocket}", "unixsocketperm 700"]
        fd = os.open(self._config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")

    def append_config(self, *lines: str) -> None:
        """Add lines to the server's config file; they apply at the next :meth:`start`."""
        with open(self._config, "a") as f:
            f.write("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port/0``."""
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix:///.../redis.sock`` (the server was made with ``unixsocket=True``)."""
        if self._unixsocket is None:
            raise RuntimeError("RedisServer(unixsocket=True) is needed for unix_url")
        return f"unix://{self._unixsocket}"

    @property
    def running(self) -> bool:
        """Whether the process is alive (paused counts as alive)."""
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 10.0) -> None:
        """Start the server (again, on the same port) and wait until it answers PING.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout`` s (with its log tail).
        """
        if self.running:
            return
        self._proc = subprocess.Popen(
            [self.binary, str(self._config), *self._args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        weakref.finalize(self, _kill, self._proc)
        self._paused = False
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self._proc.returncode} at start: {self.log_tail()}"
                )
            try:
                if self.command("PING", timeout=0.5) == b"PONG":
                    return
            except (OSError, RuntimeError):
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING: {self.log_tail()}")
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``timeout`` s); the data is gone."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self.resume()
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL the server at once."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._paused = False

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing until :meth:`resume`."""
        if self.running and not self._paused:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.running and self._paused:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGCONT)
        self._paused = False

    def cleanup(self) -> None:
        """Stop the server and remove its folder."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def command(self, *args: str | bytes, timeout: float = 2.0) -> object:
        """Run one command on the server (authenticated); see :func:`resp_command`."""
        return resp_command(self.port, *args, password=self.password, timeout=timeout)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log (for error messages)."""
        try:
            text = (self.dir / "redis.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
