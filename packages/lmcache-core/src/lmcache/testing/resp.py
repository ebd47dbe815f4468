# SPDX-License-Identifier: Apache-2.0
"""A minimal RESP client over a plain socket, so the test servers need no redis-py.

:func:`resp_command` sends one command (after ``AUTH`` when given a password) on a fresh
connection and returns the parsed reply.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import BinaryIO

__all__ = ["HOST", "resp_command"]

HOST = "127.0.0.1"


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
