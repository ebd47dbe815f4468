# SPDX-License-Identifier: Apache-2.0
"""Real Redis/Valkey servers for tests: one server, a 3-master cluster, or a Sentinel.

Each server is a ``redis-server`` (or ``valkey-server``) process on ``127.0.0.1``, on a free
port, with its own temporary folder and no persistence (``save ''``, ``appendonly no``)::

    from lmcache.testing.redis_server import RedisServer, redis_server_path

    if redis_server_path() is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    with RedisServer(password="s3cret") as server:
        tier = RedisTier(server.url)
        server.pause()   # SIGSTOP: connections hang until resume()
        server.resume()
        server.stop()    # SHUTDOWN; start() brings it back on the same port (empty)
        server.start()

:class:`RedisClusterServer` starts three masters with ``cluster-enabled yes`` and joins them with
``redis-cli --cluster create``; :class:`RedisSentinel` watches a :class:`RedisServer`. The
helpers speak RESP over a plain socket, so they need no redis-py. Processes are killed when their
object is garbage-collected or the interpreter exits, even without ``stop()``.

``LMCACHE_REDIS_SERVER`` may name the server binary (``redis-cli``/``valkey-cli`` is looked up
beside it, then on ``PATH``).
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
from typing import BinaryIO, Self, TypeVar
from urllib.parse import quote

__all__ = [
    "RedisClusterServer",
    "RedisSentinel",
    "RedisServer",
    "redis_cli_path",
    "redis_server_path",
    "resp_command",
]

HOST = "127.0.0.1"

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


def resp_command(
    port: int,
    *args: str | bytes,
    password: str | None = None,
    timeout: float = 2.0,
    host: str = HOST,
) -> object:
    """Send one command over a fresh connection and return the reply (no redis-py needed).

    Returns:
        ``bytes`` for simple and bulk strings, ``int``, ``None`` for nil, or a list.

    Raises:
        OSError: no connection or a timeout.
        RuntimeError: the server replied with an error.
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        reader = sock.makefile("rb")
        commands: list[Sequence[str | bytes]] = []
        if password is not None:
            commands.append(("AUTH", password))
        commands.append(args)
        for command in commands:
            parts = [b"*%d\r\n" % len(command)]
            for arg in command:
                data = arg.encode() if isinstance(arg, str) else arg
                parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
            sock.sendall(b"".join(parts))
        reply: object = None
        for _ in commands:
            reply = _parse(reader)
        return reply


def _parse(reader: BinaryIO) -> object:
    line = reader.readline()
    if not line:
        raise OSError("connection closed by the server")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body
    if kind == b"-":
        raise RuntimeError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        if size < 0:
            return None
        data = reader.read(size + 2)
        return data[:-2]
    if kind == b"*":
        count = int(body)
        return None if count < 0 else [_parse(reader) for _ in range(count)]
    raise RuntimeError(f"unexpected RESP reply {line!r}")


def _quoted(value: str) -> str:
    """``value`` as a double-quoted redis.conf string."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class _Started(ABC):
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


def _wait_for(
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


class RedisServer(_Started):
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
            lines.append(f"requirepass {_quoted(password)}")
        if self._unixsocket is not None:
            lines += [f"unixsocket {self._unixsocket}", "unixsocketperm 700"]
        fd = os.open(self._config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _append_config(self, *lines: str) -> None:
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


class RedisClusterServer(_Started):
    """A Redis Cluster of ``masters`` masters (no replicas) on ``127.0.0.1`` (context manager).

    Args:
        masters: How many masters (Redis needs at least 3).
        password: ``requirepass`` and ``masterauth`` of every node.

    Raises:
        RuntimeError: (from :meth:`start`) the binary has no cluster mode, ``redis-cli`` is
            missing, or the cluster did not reach ``cluster_state:ok``; the message says which.
    """

    def __init__(self, masters: int = 3, *, password: str | None = None) -> None:
        args: tuple[str, ...] = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        args += ("--cluster-node-timeout", "2000")
        self.password = password
        self.nodes = [RedisServer(password=password, args=args) for _ in range(masters)]
        if password is not None:
            for node in self.nodes:
                node._append_config(f"masterauth {_quoted(password)}")

    @property
    def url(self) -> str:
        """``redis+cluster://[:password@]127.0.0.1:port`` of the first node."""
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"redis+cluster://{auth}{HOST}:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start the nodes, create the cluster, and wait for ``cluster_state:ok`` everywhere."""
        cli = redis_cli_path()
        if cli is None:
            raise RuntimeError("RedisClusterServer: redis-cli/valkey-cli not found")
        for node in self.nodes:
            node.start()
        info = node.command("INFO", "cluster")
        if not isinstance(info, bytes) or b"cluster_enabled:1" not in info:
            raise RuntimeError(f"{node.binary} does not run in cluster mode here: {info!r}")
        command = [cli, "--cluster", "create", *(f"{HOST}:{n.port}" for n in self.nodes)]
        command += ["--cluster-replicas", "0", "--cluster-yes"]
        env = dict(os.environ)
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password  # not on the command line
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        _wait_for(
            lambda: [n.command("CLUSTER", "INFO") for n in self.nodes],
            lambda states: all(isinstance(s, bytes) and b"cluster_state:ok" in s for s in states),
            timeout,
            "cluster did not reach cluster_state:ok",
        )

    def stop(self) -> None:
        """Stop every node (their folders stay until :meth:`cleanup`)."""
        for node in self.nodes:
            node.stop()

    def cleanup(self) -> None:
        """Stop every node and remove the folders."""
        for node in self.nodes:
            node.cleanup()


class RedisSentinel(_Started):
    """A Sentinel (``redis-server --sentinel``) watching ``master`` (context manager).

    Args:
        master: The running server to watch.
        service: The master's name in Sentinel.
    """

    def __init__(self, master: RedisServer, service: str = "mymaster") -> None:
        self.master = master
        self.service = service
        lines = [f"sentinel monitor {service} {HOST} {master.port} 1"]
        if master.password is not None:
            lines.append(f"sentinel auth-pass {service} {_quoted(master.password)}")
        self.server = RedisServer(args=("--sentinel",))
        self.server._append_config(*lines)

    @property
    def url(self) -> str:
        """``redis+sentinel://[:password@]127.0.0.1:port/service`` (the master's password)."""
        password = self.master.password
        auth = f":{quote(password, safe='')}@" if password is not None else ""
        return f"redis+sentinel://{auth}{HOST}:{self.server.port}/{self.service}"

    def start(self, timeout: float = 10.0) -> None:
        """Start the sentinel and wait until it names the master."""
        self.server.start(timeout)
        _wait_for(
            lambda: self.server.command("SENTINEL", "get-master-addr-by-name", self.service),
            lambda found: found == [HOST.encode(), str(self.master.port).encode()],
            timeout,
            "sentinel does not know the master",
        )

    def cleanup(self) -> None:
        """Stop the sentinel and remove its folder."""
        self.server.cleanup()
