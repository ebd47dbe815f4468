# SPDX-License-Identifier: Apache-2.0
"""Parsing and masking of the remote tier's ``remote_url`` (forms: :mod:`lmcache.tiers.redis.tier`).

:func:`parse_remote_url` validates a URL before any connection is made and raises
:class:`~lmcache.errors.ConfigError` naming ``remote_url``, the expected forms and the fix, with
the password masked by :func:`mask_url` (which also masks ``password=`` query parameters).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from lmcache.errors import ConfigError

__all__ = ["RemoteTarget", "mask_url", "parse_remote_url"]

_Mode = Literal["standalone", "cluster", "sentinel"]

_STANDALONE = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}
_FORMS = (
    "redis://[user:password@]host[:port][/db], rediss://... (TLS), valkey://..., valkeys://..., "
    "unix:///path/to/socket[?db=N], redis+cluster://host[:port] (Redis Cluster), or "
    "redis+sentinel://host[:port][,host2[:port2]]/service_name[/db] (Sentinel)"
)
#: Query parameters passed on to redis-py (TLS settings; db for unix sockets).
_QUERY_KEYS = frozenset(
    {
        "db",
        "password",
        "username",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_ca_data",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_check_hostname",
        "ssl_min_version",
    }
)


def mask_url(url: str) -> str:
    """``url`` with its password (userinfo after ``:``, or ``password=`` in the query) as ``***``.

    A userinfo without ``:`` is masked whole (redis-py would take it as a user name, but it is
    usually a password written without the leading ``:``). Works on malformed URLs too.
    """
    sep = url.find("://")
    head, rest = (url[: sep + 3], url[sep + 3 :]) if sep >= 0 else ("", url)
    at = rest.rfind("@")
    if at >= 0:
        userinfo = rest[:at]
        user = userinfo.split(":", 1)[0] + ":***" if ":" in userinfo else "***"
        rest = f"{user}@{rest[at + 1 :]}"
    rest = re.sub(r"(?i)([?&;]password=)[^&;#]*", r"\1***", rest)
    return head + rest


def _bad_url(url: str, found_problem: str, fix: str) -> ConfigError:
    return ConfigError(
        f"Invalid lmcache config key 'remote_url': expected {_FORMS}; found "
        f"{mask_url(url)!r} ({found_problem}). {fix}"
    )


@dataclass(frozen=True)
class RemoteTarget:
    """A parsed ``remote_url``: what to connect to, without the password in any repr."""

    mode: _Mode
    #: For standalone and cluster: the URL redis-py parses (scheme mapped to redis/rediss/unix).
    url: str = field(repr=False)
    #: For sentinel: the sentinels, the service name, the db and whether TLS is on.
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    ssl: bool = False
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)


def _port(url: str, text: str, default: int) -> int:
    if not text:
        return default
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise _bad_url(url, f"port {text!r} is not a number in 1..65535", "Fix the port.")
    return int(text)


def _split_host_port(url: str, hostport: str, default: int) -> tuple[str, int]:
    if hostport.startswith("["):  # [ipv6]:port
        end = hostport.find("]")
        if end < 0:
            raise _bad_url(url, "unclosed '[' in the host", "Write IPv6 hosts as [::1]:6379.")
        host, rest = hostport[1:end], hostport[end + 1 :]
        if rest and not rest.startswith(":"):
            raise _bad_url(url, f"unexpected {rest!r} after the host", "Write [::1]:6379.")
        return host, _port(url, rest[1:], default)
    host, _, port = hostport.partition(":")
    if not host:
        raise _bad_url(url, "no host", "Add the server's host name or address.")
    return host, _port(url, port, default)


def _check_query(url: str, query: str) -> None:
    for name, _ in parse_qsl(query, keep_blank_values=True):
        if name not in _QUERY_KEYS:
            raise _bad_url(
                url,
                f"unknown query parameter {name!r}",
                f"Use only {sorted(_QUERY_KEYS)}; timeouts are RedisTier arguments.",
            )


def parse_remote_url(url: str) -> RemoteTarget:
    """Validate ``url`` and split it into what the client constructors need.

    Raises:
        ConfigError: unknown scheme or malformed URL (the password masked in the message).
    """
    if not isinstance(url, str) or "://" not in url:
        raise _bad_url(
            str(url), "no scheme", "Write the URL with a scheme, e.g. redis://host:6379."
        )
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    base, _, variant = scheme.partition("+")
    if scheme == "unix":
        parts = urlsplit(url)
        if not parts.path or parts.path == "/":
            raise _bad_url(url, "no socket path", "Write unix:///path/to/redis.sock.")
        _check_query(url, parts.query)
        return RemoteTarget("standalone", url)
    if base not in _STANDALONE or variant not in ("", "cluster", "sentinel"):
        raise _bad_url(
            url,
            f"unknown scheme {scheme!r}",
            "Use redis, rediss, valkey or valkeys, optionally with +cluster or +sentinel, or unix.",
        )
    mapped = _STANDALONE[base]
    authority, slash, path_query = rest.partition("/")
    path, _, query = path_query.partition("?")
    if not slash and "?" in authority:
        authority, _, query = authority.partition("?")
    _check_query(url, query)
    userinfo, at, hosts = authority.rpartition("@")
    if not at:
        userinfo, hosts = "", authority
    if not hosts:
        raise _bad_url(url, "no host", "Add the server's host, e.g. redis://localhost:6379.")
    if variant == "sentinel":
        sentinels = tuple(_split_host_port(url, h, 26379) for h in hosts.split(","))
        service, _, db_text = path.strip("/").partition("/")
        if not service:
            raise _bad_url(
                url, "no service name", "Add the master's name: redis+sentinel://host/mymaster."
            )
        if db_text and not db_text.isdigit():
            raise _bad_url(url, f"db {db_text!r} is not a number", "Write the db as /0.")
        username, _, password = userinfo.partition(":")
        return RemoteTarget(
            "sentinel",
            url,
            sentinels=sentinels,
            service=unquote(service),
            db=int(db_text or 0),
            ssl=mapped == "rediss",
            username=unquote(username) or None,
            password=unquote(password) or None,
        )
    if "," in hosts:
        raise _bad_url(
            url,
            "several hosts",
            "Give one host (a cluster discovers the rest) or use redis+sentinel://.",
        )
    _split_host_port(url, hosts, 6379)
    db_text = path.strip("/")
    if db_text and not db_text.isdigit():
        raise _bad_url(url, f"db {db_text!r} is not a number", "Write the db as /0.")
    if variant == "cluster" and db_text not in ("", "0"):
        raise _bad_url(url, f"db {db_text} on a cluster", "Redis Cluster has only db 0; drop it.")
    return RemoteTarget(
        "cluster" if variant == "cluster" else "standalone", mapped + "://" + rest.rstrip("/")
    )
